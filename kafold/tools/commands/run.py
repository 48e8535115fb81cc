"""`kafold run -c FILE`: the local main job: dev stack, topics, traffic, demo receiver, daemon, live view."""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from kafold import config, logs, topics
from kafold.client import CommandClient
from kafold.refs import import_ref
from kafold.tools.cli import add_config_arg
from kafold.tools.commands.daemon import run as run_daemon
from kafold.tools.commands.dev import add_broker_args
from kafold.tools.commands.run_view import DemoReceiver, LiveView
from kafold.tools.dev import stack as devstack

log = logs.get("kafold.run")


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="run the main job locally: dev stack, topics, traffic generator, daemon")
    add_config_arg(p)
    p.add_argument("--traffic", default="bank_traffic:commands", metavar="MODULE:FUNCTION",
                   help="command generator function(rng) yielding (aggregate id, command dataclass) for the first "
                        "aggregate; '' for none (default: the bank example's)")
    p.add_argument("--rate", type=float, default=200.0, help="commands per second the generator sends")
    p.add_argument("--keep-stack", action="store_true", help="leave the dev stack running on exit")
    add_broker_args(p)
    p.add_argument("--receiver-port", type=int, default=8089,
                   help="port of the demo webhook receiver on 127.0.0.1 (0: do not start it)")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    loaded = config.load_file(args.config)
    running = devstack.status()
    if running is not None and args.broker and running.kind != args.broker:
        print(f"a {running.kind} dev stack is running in {running.state_dir}; stop it with `kafold dev down` to run "
              f"on {args.broker}")
        return 1
    started_stack = _start_stack(args, loaded.config, running)
    cfg = devstack.effective(loaded.config)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    parts = _Parts(DemoReceiver(args.receiver_port) if args.receiver_port else None)
    try:
        return _run(args, cfg, loaded, stop, parts)
    finally:
        stop.set()
        parts.stop()
        if parts.terminal is not None:  # the view has stopped drawing: what follows is printed on the terminal
            parts.terminal.restore()
        _stop_jobs()
        for s, h in previous.items():
            signal.signal(s, h)
        if started_stack and not args.keep_stack:
            devstack.down()
            print("dev stack stopped")


def _start_stack(args: argparse.Namespace, cfg: config.KafoldConfig, running: Any) -> bool:
    """Start a fresh dev stack unless the configuration names a broker and PostgreSQL or one runs; True if started."""
    if (cfg.kafka.bootstrap_servers and cfg.postgres.url) or running is not None:
        return False
    # Fresh: tansu is memory-only, so the last run's events are gone; PostgreSQL's data derived from them
    # (checkpoints past the new topics' ends, tracking rows, projections) is dropped with them. A demo on
    # Apache Kafka starts from empty topics too, so both stacks begin alike.
    stack = devstack.up(fresh=True, broker=args.broker, nodes=args.nodes)
    print(f"dev stack up (fresh): broker {stack.bootstrap_servers}, PostgreSQL {stack.postgres_url}")
    return True


@dataclasses.dataclass
class _Parts:
    """What `kafold run` starts beside the daemon; `stop` ends each (after the shared stop event is set)."""

    receiver: DemoReceiver | None
    generator: threading.Thread | None = None
    view: LiveView | None = None
    terminal: _ViewTerminal | None = None
    sent: list[int] = dataclasses.field(default_factory=lambda: [0])

    def stop(self) -> None:
        if self.generator is not None:
            self.generator.join(5)
        if self.view is not None:
            self.view.join(5)
        if self.receiver is not None:
            self.receiver.stop()


def _run(args: argparse.Namespace, cfg: config.KafoldConfig, loaded: config.Loaded, stop: threading.Event,
         parts: _Parts) -> int:
    """Topics, the demo receiver, the traffic generator and the live view, then the daemon until `stop`."""
    receiver, sent = parts.receiver, parts.sent
    if receiver is not None and receiver.start():
        print(f"demo webhook receiver on http://127.0.0.1:{args.receiver_port}/")
    report = topics.ensure(cfg.kafka, config.topic_map(cfg).values())
    print(report.table())
    if not report.ok:
        return 1
    print(f"daemon running on {args.config}")
    print(f"query the projections: psql '{cfg.postgres.url}' -c 'SELECT * FROM accounts LIMIT 10'")
    view, log_file = None, None
    if cfg.daemon.http_port:
        print(f"metrics: http://127.0.0.1:{cfg.daemon.http_port}/metrics   status: kafold status -c {args.config}")
        parts.view = view = LiveView(cfg, receiver, lambda: sent[0], stop)
        if view.tty:  # anything printed through the live table would tear it: it all goes to a file instead
            log_file = devstack.default_state_dir().parent / "run.log"
            print(f"logs: {log_file}")
    print("Ctrl-C stops everything", flush=True)
    if view is not None:
        if log_file is not None:  # before the generator, the daemon and its children start: all write to the file
            level, fmt, _ = logs.current()
            logs.configure(level, fmt, str(log_file))
            parts.terminal = _ViewTerminal(log_file)
            view.out = parts.terminal.stream
        view.start()
    if args.traffic and cfg.aggregates:
        parts.generator = threading.Thread(target=_traffic, args=(cfg, loaded, args.traffic, args.rate, stop, sent),
                                           name="kafold-traffic", daemon=True)
        parts.generator.start()

    return run_daemon(cfg, loaded.base, stop, config_path=loaded.path)


class _ViewTerminal:
    """The terminal kept for the live view alone: this process's stdout and stderr (file descriptors 1 and 2) are
    pointed at the log file, so whatever anything writes there — a stray print, a Python warning, librdkafka, and
    every child that inherits them: the daemon's task processes, snapshot runs, their Spark JVMs' log4j — lands in
    the file; the view draws on its own copy of the terminal. `restore` gives 1 and 2 the terminal back."""

    def __init__(self, log_file: Path) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        self.stream = logs.Tolerant(open(os.dup(self._saved[0]), "w", encoding="utf-8", buffering=1))  # noqa: SIM115

    def restore(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.stream.flush()
        for fd, saved in zip((1, 2), self._saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        self.stream.close()


def _stop_jobs() -> None:
    """Snapshot jobs the daemon started (`kafold snapshot run` children and their Spark JVMs) outlive it by
    design (a run finishes on its own); `kafold run` leaves nothing behind, so they are stopped here."""
    jobs = [c for c in psutil.Process().children() if "snapshot" in " ".join(_cmdline(c))]
    procs = [p for job in jobs for p in (job, *job.children(recursive=True))]
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    if jobs:
        print(f"stopped {len(jobs)} snapshot job(s) still running")


def _cmdline(p: Any) -> list[str]:
    try:
        return list(p.cmdline())
    except Exception:
        return []


def _traffic(cfg: config.KafoldConfig, loaded: config.Loaded, ref: str, rate: float,
             stop: threading.Event, sent_total: list[int]) -> None:
    """Send the generator's commands to the first aggregate at `rate` per second (in batches every 100 ms)."""
    agg = cfg.aggregates[0]
    with config.python_path(cfg, loaded.base):
        generate = import_ref(ref)
    sent, started, pending = 0, time.monotonic(), []
    with CommandClient(cfg.kafka, agg) as client:
        for aggregate_id, command in generate(random.Random(7)):
            if stop.is_set():
                break
            data = {f.name: getattr(command, f.name) for f in dataclasses.fields(command)}
            pending.append(client.command(aggregate_id, type(command).__name__, data))
            ahead = (sent + len(pending)) / rate - (time.monotonic() - started)
            if ahead > 0 or len(pending) >= 1000:
                client.send_many(pending, wait=False)
                sent += len(pending)
                sent_total[0] = sent
                pending = []
                if ahead > 0:
                    stop.wait(ahead)
    log.info("run.traffic_stopped", commands=sent, topic=agg.topic("commands"))
