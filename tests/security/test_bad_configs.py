"""Bad configurations beyond tests/config/test_config.py: each names its key path and the problem, never echoes a
secret, and `kafold config validate` exits 2 printing one line per problem. docs/security.md lists every kind."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kafold import config
from kafold.errors import ConfigError

SECRET = f"hunter2-{uuid.uuid4().hex}"
ENV = {"KAFOLD_TEST_SECRET": SECRET}
SASL = '[kafka]\nsecurity_protocol = "SASL_SSL"\nsasl_mechanism = "SCRAM-SHA-512"\nsasl_username = "u"\n'


def projection(table: str = "accounts", schema: str = "public", column: str = "id", sql_type: str = "text",
               extra: str = "") -> str:
    return f"""
[[connectors]]
name = "p"
class = "postgres-projection"
topics = ["t"]
[connectors.config]
table = {json.dumps(table)}
schema = {json.dumps(schema)}
key_columns = [{json.dumps(column)}]
columns = {{{json.dumps(column)} = {json.dumps(sql_type)}}}
{extra}
[[connectors.config.on]]
type = "Opened"
"""


def webhook(extra: str) -> str:
    return f'[[connectors]]\nname = "w"\nclass = "webhook"\ntopics = ["t"]\n[connectors.config]\n{extra}\n'


# kind -> (TOML text, key path the problem must name, fragment of the message); {secret} and {world} are filled in.
NEW_KINDS: dict[str, tuple[str, str, str]] = {
    "secret_file_missing": ('[postgres]\npassword_file = "/nonexistent/kafold-pg"\n', "postgres.password_file",
                            "does not exist"),
    "secret_env_and_file": ('[postgres]\npassword_env = "KAFOLD_TEST_SECRET"\npassword_file = "{world}"\n',
                            "postgres.password", "give only one of password_env and password_file"),
    "secret_env_not_a_name": ('[daemon]\napi_token_env = 5\n', "daemon.api_token_env",
                              "expected the name of an environment variable"),
    "password_in_url_query": ('[postgres]\nurl = "postgresql://app@db/x?password={secret}"\n', "postgres.url",
                              "literal password="),
    "literal_secret_in_connector": (webhook('url = "https://h.example/x"\nsecret = "{secret}"'),
                                    "connectors[0].config.secret", "literal secrets are refused"),
    "plain_http_webhook": (webhook('url = "http://h.example/x"'), "connectors[0].config", "plain http"),
    "credentials_in_webhook_url": (webhook('url = "https://u:{secret}@h.example/x?token={secret}"'),
                                   "connectors[0].config", "credentials in the URL"),
    "hostile_table_name": (projection(table="x; DROP TABLE y"), "connectors[0].config: table",
                           "not a valid SQL identifier"),
    "quoted_table_name": (projection(table='"a"'), "connectors[0].config: table", "not a valid SQL identifier"),
    "hostile_schema_name": (projection(schema="public.x"), "connectors[0].config: schema",
                            "not a valid SQL identifier"),
    "hostile_column_name": (projection(column='id" text); DROP TABLE y; --'),
                            'connectors[0].config: columns.id"', "not a valid SQL identifier"),
    "hostile_sql_type": (projection(sql_type="text); DROP TABLE y; --"), "connectors[0].config: columns.id",
                         "not a plain SQL type name"),
    "reserved_column": (projection(column="_kafold_version"), "connectors[0].config: columns._kafold_version",
                        "reserved"),
    "invalid_topic_name": ('[[topics]]\nname = "../etc passwd"\n', "topics", "invalid topic name"),
    "invalid_connector_name": ('[[connectors]]\nname = "a b"\nclass = "log"\ntopics = ["t"]\n',
                               "connectors[0].name", "use letters, digits"),
    "duplicate_aggregate": ('[[aggregates]]\nname = "a"\ninitial = "m:i"\nevolve = "m:e"\ndecide = "m:d"\n' * 2,
                            "aggregates[1].name", "duplicate aggregate name"),
    "not_a_postgres_url": ('[postgres]\nurl = "mysql://db/x"\n', "postgres.url", "expected a postgresql:// URL"),
    "section_not_a_table": ("kafka = 5\n", "kafka", "expected a table"),
    "wrong_boolean": ('[postgres]\nmigrate_on_start = "maybe"\n', "postgres.migrate_on_start", "expected a boolean"),
    "sasl_settings_ignored": ('[kafka]\nsasl_username = "u"\nsasl_password_env = "KAFOLD_TEST_SECRET"\n',
                              "kafka.security_protocol", "ignores sasl_username, sasl_password"),
    "sasl_without_mechanism": ('[kafka]\nsecurity_protocol = "SASL_SSL"\n', "kafka.sasl_mechanism", "required"),
    "scram_without_password": (SASL, "kafka.sasl_password", "required with sasl_mechanism"),
    "tls_settings_ignored": ('[kafka]\nssl_ca_location = "{world}"\n', "kafka.security_protocol",
                             "ignores ssl_ca_location"),
    "tls_ca_file_missing": ('[kafka]\nsecurity_protocol = "SSL"\nssl_ca_location = "/nonexistent/ca.pem"\n',
                            "kafka.ssl_ca_location", "does not exist"),
    "client_cert_without_key": ('[kafka]\nsecurity_protocol = "SSL"\nssl_certificate_location = "{world}"\n',
                                "kafka.ssl_key_location", "give both"),
    "pg_root_cert_missing": ('[postgres]\nsslmode = "verify-full"\nsslrootcert = "/nonexistent/root.crt"\n',
                             "postgres.sslrootcert", "does not exist"),
    "hostile_kafold_schema": ('[postgres]\nschema = "kafold; DROP SCHEMA public"\n', "postgres.schema",
                              "not a valid SQL identifier"),
    "pg_client_cert_without_key": ('[postgres]\nsslcert = "{world}"\n', "postgres.sslkey", "give both"),
    "projection_key_not_a_column": (projection().replace('key_columns = ["id"]', 'key_columns = ["nope"]'),
                                    "connectors[0].config: key_columns", "'nope' is not in `columns`"),
}
# Kinds tests/config/test_config.py covers (its BAD table, its world-readable secret file and bad env override tests).
EXISTING_KINDS = 17 + 2


def problems_for(text: str, tmp_path: Path) -> tuple[Path, list[str]]:
    world = tmp_path / "world-readable.pem"
    world.write_text(SECRET)
    world.chmod(0o644)
    path = tmp_path / "kafold.toml"
    path.write_text(text.replace("{secret}", SECRET).replace("{world}", str(world)))
    with pytest.raises(ConfigError) as info:
        config.parse(path.read_text(), path, ENV)
    return path, info.value.problems


def test_the_corpus_has_at_least_20_kinds_and_docs_list_them() -> None:
    from tests.config.test_config import BAD

    assert len(BAD) >= 17 and not set(BAD) & set(NEW_KINDS)
    assert EXISTING_KINDS + len(NEW_KINDS) >= 20
    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    missing = [kind for kind in [*BAD, *NEW_KINDS] if f"`{kind}`" not in doc]
    assert not missing, f"docs/security.md does not list {missing}"


@pytest.mark.parametrize("kind", sorted(NEW_KINDS))
def test_bad_config_names_the_key_and_never_the_secret(kind: str, tmp_path: Path) -> None:
    text, key, message = NEW_KINDS[kind]
    path, problems = problems_for(text, tmp_path)
    assert all(p.startswith(f"{path}: ") for p in problems), problems
    assert any(f": {key}" in p and message in p for p in problems), problems
    assert SECRET not in "\n".join(problems)


def test_validate_exits_2_with_one_line_per_problem_for_every_kind(tmp_path: Path) -> None:
    """`kafold config validate` on each bad file (one interpreter for all): exit 2, one line per problem, no
    traceback, no secret."""
    expected: dict[str, list[str]] = {}
    for kind, (text, _key, _message) in NEW_KINDS.items():
        folder = tmp_path / kind
        folder.mkdir()
        path, problems = problems_for(text, folder)
        expected[str(path)] = problems
    driver = ("import contextlib, io, json, sys\nfrom kafold.tools import cli\nout = {}\n"
              "for f in sys.argv[1:]:\n    err = io.StringIO()\n"
              "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):\n"
              "        rc = cli.main(['config', 'validate', '-c', f])\n"
              "    out[f] = [rc, err.getvalue()]\nprint(json.dumps(out))\n")
    res = subprocess.run([sys.executable, "-c", driver, *expected], capture_output=True, text=True, check=False,
                         env={"PATH": "/usr/bin:/bin", **ENV}, timeout=120)
    assert res.returncode == 0, res.stderr
    for file, (rc, output) in json.loads(res.stdout).items():
        lines = output.splitlines()
        assert rc == 2, (file, output)
        assert lines[0] == "configuration error:" and [ln.strip() for ln in lines[1:]] == expected[file], output
        assert SECRET not in output + res.stderr and "Traceback" not in output
