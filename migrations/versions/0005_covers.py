"""`covers(connector, token)`: does a projection's committed checkpoint cover a consistency token (read-your-writes).

Reads the token form of kafold/tokens.py (`kf1.` + base64url of JSON {topic: {partition: offset}} + its Adler-32,
4 bytes big-endian) and answers true when, for every partition named, the connector's checkpoint (next offset,
written in the same transaction as its rows) is past the offset. STABLE: it reads the calling statement's
snapshot, so called in the same statement as a row read (READ COMMITTED) or anywhere in a REPEATABLE READ
transaction, true proves the rows read include the token's writes. A malformed token raises (SQLSTATE 22023).

Revision ID: 0005_covers
Revises: 0004_tombstones
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

revision: str = "0005_covers"
down_revision: str | None = "0004_tombstones"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    """The `[postgres].schema` the environment migrates (also where alembic_version lives)."""
    return str(op.get_context().opts.get("version_table_schema") or "kafold")


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# Every check of kafold.tokens.parse, with its wording; the whole token is checked before any checkpoint is read,
# so a bad token raises whatever the checkpoints say.
COVERS = """
CREATE FUNCTION {schema}.covers(connector text, token text) RETURNS boolean
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $covers$
DECLARE
    version text;
    text64 text;
    blob bytea;
    body bytea;
    positions jsonb;
    t record;
    p record;
    wanted bigint[] := '{{}}';
    topics text[] := '{{}}';
    parts int[] := '{{}}';
    i int;
    a bigint := 1;
    b bigint := 0;
BEGIN
    IF token IS NULL OR token = '' THEN
        RAISE EXCEPTION 'kafold.covers: empty consistency token' USING ERRCODE = '22023';
    END IF;
    IF length(token) > 8192 THEN
        RAISE EXCEPTION 'kafold.covers: consistency token too long (% characters, at most 8192)', length(token)
            USING ERRCODE = '22023';
    END IF;
    version := substring(token FROM '^kf([0-9]{{1,6}})\\.');
    IF version IS NULL THEN
        RAISE EXCEPTION 'kafold.covers: not a kafold consistency token (expected one starting with ''kf1.'')'
            USING ERRCODE = '22023';
    ELSIF version::int > 1 THEN
        RAISE EXCEPTION 'kafold.covers: consistency token of version %, newer than this kafold reads (1): upgrade '
            'kafold''s migrations', version::int USING ERRCODE = '22023';
    ELSIF version::int <> 1 THEN
        RAISE EXCEPTION 'kafold.covers: not a kafold consistency token (unknown version %)', version::int
            USING ERRCODE = '22023';
    END IF;
    text64 := substr(token, length(version) + 4);
    IF text64 !~ '^[A-Za-z0-9_-]*$' OR length(text64) % 4 = 1 THEN
        RAISE EXCEPTION 'kafold.covers: malformed consistency token (not base64url)' USING ERRCODE = '22023';
    END IF;
    blob := decode(translate(text64, '-_', '+/') || repeat('=', (4 - length(text64) % 4) % 4), 'base64');
    IF length(blob) <= 4 THEN
        RAISE EXCEPTION 'kafold.covers: consistency token truncated or altered (its checksum does not match)'
            USING ERRCODE = '22023';
    END IF;
    body := substring(blob FROM 1 FOR length(blob) - 4);
    FOR i IN 0 .. length(body) - 1 LOOP  -- Adler-32
        a := (a + get_byte(body, i)) % 65521;
        b := (b + a) % 65521;
    END LOOP;
    IF substring(int8send(b * 65536 + a) FROM 5 FOR 4) <> substring(blob FROM length(blob) - 3) THEN
        RAISE EXCEPTION 'kafold.covers: consistency token truncated or altered (its checksum does not match)'
            USING ERRCODE = '22023';
    END IF;
    BEGIN
        positions := convert_from(body, 'UTF8')::jsonb;
    EXCEPTION WHEN others THEN
        RAISE EXCEPTION 'kafold.covers: malformed consistency token (its body is not JSON)' USING ERRCODE = '22023';
    END;
    IF jsonb_typeof(positions) <> 'object' OR positions = '{{}}'::jsonb THEN
        RAISE EXCEPTION 'kafold.covers: malformed consistency token (it names no position)' USING ERRCODE = '22023';
    END IF;
    FOR t IN SELECT key, value FROM jsonb_each(positions) LOOP
        IF t.key = '' OR jsonb_typeof(t.value) <> 'object' OR t.value = '{{}}'::jsonb THEN
            RAISE EXCEPTION 'kafold.covers: malformed consistency token (topic %: no partitions)', t.key
                USING ERRCODE = '22023';
        END IF;
        FOR p IN SELECT key, value FROM jsonb_each(t.value) LOOP
            IF p.key !~ '^[0-9]{{1,10}}$' OR p.key::bigint > 2147483647 THEN
                RAISE EXCEPTION 'kafold.covers: malformed consistency token (topic %: partition %)', t.key, p.key
                    USING ERRCODE = '22023';
            END IF;
            IF jsonb_typeof(p.value) <> 'number' OR p.value::text !~ '^[0-9]{{1,19}}$'
                    OR p.value::text::numeric > 9223372036854775807 THEN
                RAISE EXCEPTION 'kafold.covers: malformed consistency token (%[%]: offset %)', t.key, p.key, p.value
                    USING ERRCODE = '22023';
            END IF;
            topics := topics || t.key;
            parts := parts || p.key::int;
            wanted := wanted || p.value::text::bigint;
        END LOOP;
    END LOOP;
    FOR i IN 1 .. array_length(wanted, 1) LOOP
        IF NOT EXISTS (SELECT 1 FROM {schema}.checkpoints c WHERE c.connector = covers.connector
                       AND c.topic = topics[i] AND c.partition = parts[i] AND c.next_offset > wanted[i]) THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN true;
END
$covers$
"""


def upgrade() -> None:
    schema = _ident(_schema())
    op.execute(COVERS.format(schema=schema))
    op.execute(f"COMMENT ON FUNCTION {schema}.covers(text, text) IS 'true when the connector''s committed "
               "checkpoint covers the consistency token (read-your-writes; docs/projections.md)'")


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {_ident(_schema())}.covers(text, text)")
