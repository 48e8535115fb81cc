"""One trace on Apache Kafka, from a command to the read model and the webhook: the test's CommandClient traces with
an in-memory exporter; the daemon (a subprocess) exports over OTLP/HTTP to a real receiver in this process; the
webhook receiver sees `traceparent`. The domain functions below are the aggregate's (dict events, pure)."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kafold import config, topics
from kafold.client import CommandClient
from kafold.config import KafkaConfig
from kafold.envelope import Event
from kafold.testing import free_port
from tests.daemon.daemon_support import get_json
from tests.support import ROOT, child_env, kafka_toml, wait_for
from tests.support.receiver import Receiver

KAFOLD = str(Path(sys.executable).parent / "kafold")
M = "tests.daemon.test_tracing"


# ---- the aggregate (pure) ------------------------------------------------------------------------------
def initial() -> dict[str, Any]:
    return {}


def evolve(state: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    return {"name": event["name"]}


def decide(command: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "Named", "name": command["name"]}]


def row(current: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
    return {"name": event.payload["name"]}


# ---- a real OTLP/HTTP receiver --------------------------------------------------------------------------
class Collector:
    """POST /v1/traces (protobuf ExportTraceServiceRequest) on 127.0.0.1; keeps every span received."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                with collector.lock:
                    for rs in req.resource_spans:
                        for ss in rs.scope_spans:
                            collector.spans.extend(ss.spans)
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def named(self, prefix: str) -> list[Any]:
        with self.lock:
            return [s for s in self.spans if s.name.startswith(prefix)]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _config(path: Path, kafka: KafkaConfig, pg_url: str, prefix: str, port: int, table: str, hook: str) -> Path:
    path.write_text(f"""
{kafka_toml(kafka)}
[daemon]
group_prefix = "{prefix}"
http_port = {port}
python_path = ["{ROOT}"]
batch_max_wait_ms = 50

[postgres]
url = "{pg_url}"

[tracing]
enabled = true
service_name = "kafold-test"

[[aggregates]]
name = "thing"
initial = "{M}:initial"
evolve = "{M}:evolve"
decide = "{M}:decide"
partitions = 1
events_topic = "{prefix}.events"
commands_topic = "{prefix}.commands"
results_topic = "{prefix}.results"
snapshot_topic = "{prefix}.snapshots"

[[connectors]]
name = "hook-{table}"
class = "webhook"
topics = ["{prefix}.events"]
[connectors.config]
url = "{hook}"
allow_http = true

[[connectors]]
name = "{table}"
class = "postgres-projection"
topics = ["{prefix}.events"]
[connectors.config]
table = "{table}"
key_columns = ["thing_id"]
mapper = "{M}:row"
[connectors.config.columns]
thing_id = "text"
name = "text"
""")
    return path


def _rows(pg_url: str, table: str) -> int:
    try:
        with psycopg.connect(pg_url) as conn:
            return len(conn.execute(f'SELECT thing_id FROM "{table}"').fetchall())
    except psycopg.errors.UndefinedTable:
        return 0


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_one_trace_from_command_to_projection_and_webhook(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    prefix, table, port = unique, f"things_{unique[-8:]}", free_port()
    receiver, collector = Receiver(), Collector()
    conf = _config(tmp_path / "kafold.toml", kafka_config, pg_url, prefix, port, table, receiver.start())
    loaded = config.load_file(conf)
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    env = child_env({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "100",
                     "OTEL_TRACES_SAMPLER": "parentbased_always_on"})
    with open(tmp_path / "daemon.log", "ab") as out:
        proc = subprocess.Popen([KAFOLD, "--log-format", "json", "daemon", "-c", str(conf)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    client = CommandClient(kafka_config, loaded.config.aggregates[0], tracer_provider=provider)
    try:
        wait_for(lambda: get_json(port, "/ready")[0] == 200 or proc.poll() is not None, "the daemon ready", 120)
        assert proc.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
        with provider.get_tracer("test").start_as_current_span("checkout") as outer:
            result = client.send(client.command("t-1", "Name", {"name": "one"}), timeout=60)
        assert result is not None and result.accepted
        trace_id = outer.get_span_context().trace_id
        wait_for(lambda: _rows(pg_url, table) == 1, "the projection's row", 90)
        wait_for(lambda: bool(receiver.successes()), "the webhook request", 90)
        wait_for(lambda: all(collector.named(n) for n in ("handle thing", f"put {table}", f"effect hook-{table}")),
                 "the daemon's spans at the OTLP receiver", 60)
    finally:
        client.close()
        proc.terminate()
        proc.wait(60)
        receiver.stop()
        collector.stop()

    # the client's side: the command span, a child of the application's span
    sent = [s for s in exporter.get_finished_spans() if s.name == "send thing Name"]
    assert len(sent) == 1 and sent[0].context.trace_id == trace_id
    assert sent[0].parent is not None and sent[0].parent.span_id == outer.get_span_context().span_id
    send_span_id = sent[0].context.span_id.to_bytes(8, "big")
    tid = trace_id.to_bytes(16, "big")

    # the aggregate's span: a child of the command's
    handled = [s for s in collector.named("handle thing") if s.trace_id == tid]
    assert len(handled) == 1 and handled[0].parent_span_id == send_span_id
    # the projection's batch span links to the aggregate's span (the context on the event)
    puts = collector.named(f"put {table}")
    assert any(link.trace_id == tid and link.span_id == handled[0].span_id for s in puts for link in s.links)
    # the webhook's effect span continues the trace; the request the receiver saw carries it
    effects = [s for s in collector.named(f"effect hook-{table}") if s.trace_id == tid]
    assert effects and effects[0].parent_span_id == handled[0].span_id
    traceparents = {r.headers.get("traceparent", r.headers.get("Traceparent")) for r in receiver.successes()}
    # version-trace id-parent id-flags (sampled; newer SDKs also set the random-trace-id flag)
    assert f"00-{trace_id:032x}-{effects[0].span_id.hex()}" in {t.rsplit("-", 1)[0] for t in traceparents if t}
