"""The daemon's long-poll wait on a real broker, against hostile callers: a token or `timeout_ms` of thousands of
digits is a 400 naming the parameter (never a 500), and waits past `daemon.max_waits` at once are a 503 with
`Retry-After` while the ones in progress go on."""

from __future__ import annotations

import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kafold import tokens
from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.daemon.daemon_support import daemon_in_process, write_config
from tests.support import create_topic, wait_for


def _forged(body: bytes) -> str:
    """A token with a correct checksum around `body` (what a forger who read kafold/tokens.py makes)."""
    import base64
    import zlib

    blob = body + zlib.adler32(body).to_bytes(4, "big")
    return "kf1." + base64.urlsafe_b64encode(blob).rstrip(b"=").decode()


def _wait(port: int, token: str, timeout_ms: str) -> tuple[int, Any, dict[str, str]]:
    query = urllib.parse.urlencode({"token": token, "timeout_ms": timeout_ms})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/connectors/sink/wait?{query}", timeout=20) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_huge_numbers_are_400_and_waits_past_the_cap_are_503_with_retry_after(
        tmp_path: Path, kafka_config: KafkaConfig, pg_url: str, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic)
    # a projection: its waits read its checkpoints in PostgreSQL
    path = write_config(tmp_path, kafka_config, unique, topic, port=free_port(), connector="postgres-projection",
                        config_toml=f'{{ table = "w_{uuid.uuid4().hex[:10]}", key_columns = ["id"], columns = '
                        '{ id = "text", n = "bigint" }, on = [{ type = "ThingHappened", set = { n = "payload.n" } }] }',
                        daemon_extra=f'max_waits = 2\n\n[postgres]\nurl = "{pg_url}"')
    far = tokens.encode({(topic, 0): 10**9})  # never covered: a wait on it lasts its whole timeout
    with daemon_in_process(path) as d:
        status, body, _ = _wait(d.port, far, "9" * 5000)
        assert status == 400 and b"timeout_ms" in body, body[:200]
        huge_partition = _forged(b'{"%s":{"%s":1}}' % (topic.encode(), b"7" * 5000))
        assert len(huge_partition) < tokens.MAX_CHARS
        status, body, _ = _wait(d.port, huge_partition, "10")
        assert status == 400 and b"token" in body, body[:200]

        held: list[int] = []
        waits = [threading.Thread(target=lambda: held.append(_wait(d.port, far, "2500")[0])) for _ in range(2)]
        for t in waits:
            t.start()
        wait_for(lambda: d.host.watches.active == 2, "two waits in progress")
        status, body, headers = _wait(d.port, far, "2500")
        assert status == 503 and b"max_waits" in body, body[:200]
        assert headers.get("Retry-After") == "1"
        for t in waits:
            t.join(20)
        assert held == [408, 408]  # the two in progress ran to their timeout
        assert _wait(d.port, far, "10")[0] == 408  # and the cap frees as they end
        # /metrics counts each answer by result; the refused one took no wait, so it is not in the durations
        samples = [s for f in text_string_to_metric_families(d.get("/metrics")[1]) for s in f.samples]
        answered = {s.labels["result"]: s.value for s in samples if s.name == "kafold_consistency_waits_total"}
        assert answered == {"timeout": 3, "refused": 1}
        assert [s.value for s in samples if s.name == "kafold_consistency_wait_duration_seconds_count"] == [3]
