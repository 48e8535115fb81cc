"""`kafold run`'s demo webhook receiver and its live view (rich on a terminal, a status line otherwise)."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from confluent_kafka import TopicPartition
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.live import Live
from rich.table import Table

from kafold import db, kafka_clients, logs
from kafold.config import KafoldConfig

log = logs.get("kafold.run")


class DemoReceiver:
    """A local HTTP target for the example's webhook connector: counts deliveries, applies each webhook-id once."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.delivered = 0
        self.seen: set[str] = set()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="kafold-demo-receiver", daemon=True)
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._runner: Any = None

    def start(self) -> bool:
        """Start serving; False (and a warning) when the port is taken — the webhook connector then retries."""
        self._thread.start()
        self._ready.wait(10)
        if self.error is not None:
            log.warning("run.receiver_not_started", port=self.port, error=str(self.error),
                        hint="the demo webhook receiver is down: the webhook connector will retry and park")
            return False
        return True

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def handle(request: web.Request) -> web.Response:
            await request.read()
            self.delivered += 1
            self.seen.add(request.headers.get("webhook-id", ""))
            return web.Response(status=204)

        app = web.Application()
        app.router.add_post("/{tail:.*}", handle)
        try:
            self._runner = web.AppRunner(app, access_log=None)
            self.loop.run_until_complete(self._runner.setup())
            self.loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        except OSError as e:
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._runner.cleanup())

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


@dataclass
class Figures:
    """One reading of the daemon's /metrics and of the stack, and the rates since the previous one."""

    at: float
    processed: dict[str, float] = field(default_factory=dict)  # connector -> kafold_events_processed
    lag: dict[str, float] = field(default_factory=dict)        # connector -> records behind
    rates: dict[str, float] = field(default_factory=dict)      # connector -> events/s
    commands_sent: int = 0
    commands_per_s: float = 0.0
    effects_delivered: int = 0
    parked_keys: int | None = None
    snapshots: int | None = None


def read_metrics(port: int) -> tuple[dict[str, float], dict[str, float]]:
    """(events processed, lag in records) per connector from the daemon's /metrics; empty while it starts."""
    processed: dict[str, float] = {}
    lag: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return processed, lag
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.labels.get("connector")
            if name is None:
                continue
            if s.name == "kafold_events_processed_total":
                processed[name] = processed.get(name, 0.0) + s.value
            elif s.name == "kafold_consumer_lag_records":
                lag[name] = lag.get(name, 0.0) + s.value
    return processed, lag


class LiveView:
    """Polls the daemon, the generator and the stack every second; draws a rich table or prints a line."""

    def __init__(self, cfg: KafoldConfig, receiver: DemoReceiver | None, commands_sent: Callable[[], int],
                 stop: threading.Event, *, tty: bool | None = None, line_every_s: float = 5.0) -> None:
        self.cfg, self.receiver, self.commands_sent, self.stop = cfg, receiver, commands_sent, stop
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.out: Any = sys.stdout  # where the table is drawn: `kafold run` hands it the terminal it keeps for it
        self.line_every_s = line_every_s
        self.last: Figures | None = None
        self.java = shutil.which("java") is not None
        self._thread = threading.Thread(target=self._loop, name="kafold-live-view", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def read(self) -> Figures:
        now = time.monotonic()
        f = Figures(now)
        f.processed, f.lag = read_metrics(self.cfg.daemon.http_port)
        if not f.processed and self.last is not None:  # a stopping daemon answers no /metrics: its last figures stay
            f.processed, f.lag = self.last.processed, self.last.lag
        f.commands_sent = self.commands_sent()
        f.effects_delivered = self.receiver.delivered if self.receiver is not None else 0
        f.parked_keys = self._parked()
        f.snapshots = self._snapshots()
        if self.last is not None and now > self.last.at:
            dt = now - self.last.at
            f.rates = {c: max(0.0, (v - self.last.processed.get(c, 0.0)) / dt) for c, v in f.processed.items()}
            f.commands_per_s = max(0.0, (f.commands_sent - self.last.commands_sent) / dt)
        self.last = f
        return f

    def _parked(self) -> int | None:
        try:
            with db.connect(self.cfg.postgres) as conn:
                row = conn.execute(f"SELECT count(*) FROM {self.cfg.postgres.schema}.effect_parked_keys").fetchone()
            return int(row[0]) if row else 0
        except Exception:  # not migrated yet, or PostgreSQL busy: shown as "-"
            return None

    def _snapshots(self) -> int | None:
        """Snapshot records written so far (the end offsets of the aggregates' snapshot topics)."""
        if not self.cfg.aggregates:
            return None
        try:
            consumer = kafka_clients.consumer(self.cfg.kafka, "kafold.run.view")
            try:
                total = 0
                for agg in self.cfg.aggregates:
                    topic = agg.topic("snapshot")
                    meta = consumer.list_topics(topic, timeout=2).topics.get(topic)
                    for p in (meta.partitions if meta is not None else {}):
                        total += consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=2)[1]
                return total
            finally:
                consumer.close()
        except Exception:
            return None

    def line(self, f: Figures) -> str:
        conns = ", ".join(f"{c} {f.rates.get(c, 0):,.0f}/s lag {f.lag.get(c, 0):,.0f}" for c in sorted(f.processed))
        snaps = "-" if f.snapshots is None else f"{f.snapshots:,}"
        return (f"commands {f.commands_per_s:,.0f}/s ({f.commands_sent:,} sent) | {conns or 'connectors starting'} "
                f"| effects delivered {f.effects_delivered:,} | parked keys "
                f"{'-' if f.parked_keys is None else f.parked_keys} | snapshots {snaps}"
                + ("" if self.java else " (no Java: runs above local_max_events cannot use Spark)"))

    def table(self, f: Figures) -> Any:
        t = Table(title="kafold run — live (Ctrl-C stops everything)", expand=False)
        t.add_column("what")
        t.add_column("figure", justify="right")
        t.add_row("commands sent", f"{f.commands_sent:,} ({f.commands_per_s:,.0f}/s)")
        for c in sorted(f.processed):
            t.add_row(f"connector {c}", f"{f.processed[c]:,.0f} events, {f.rates.get(c, 0):,.0f}/s, lag "
                                        f"{f.lag.get(c, 0):,.0f}")
        t.add_row("effects delivered (demo receiver)", f"{f.effects_delivered:,}")
        t.add_row("parked keys", "-" if f.parked_keys is None else str(f.parked_keys))
        t.add_row("snapshots written", ("-" if f.snapshots is None else f"{f.snapshots:,}")
                  + ("" if self.java else " (no Java: in-process runs only)"))
        return t

    def _follow_size(self, console: Any) -> None:
        """The console's size is its terminal's (rich would ask file descriptors 0-2, which may not be it)."""
        try:
            console.size = os.get_terminal_size(self.out.fileno())
        except (AttributeError, ValueError, OSError):
            pass

    def _loop(self) -> None:
        if self.tty:
            console = Console(file=self.out)
            self._follow_size(console)
            # Not redirected through the table: whatever this process prints goes where its stdout and stderr point
            # (the log file while the view owns the terminal).
            with Live(self.table(self.read()), console=console, refresh_per_second=2, transient=False,
                      redirect_stdout=False, redirect_stderr=False) as live:
                while not self.stop.wait(1.0):
                    self._follow_size(console)
                    live.update(self.table(self.read()))
            return
        last_line = 0.0
        while not self.stop.wait(1.0):
            f = self.read()
            if f.at - last_line >= self.line_every_s:
                print(self.line(f), flush=True)
                last_line = f.at
