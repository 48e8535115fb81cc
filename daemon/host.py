"""The daemon host: a Faust worker (Kafka consumer off) running sink tasks and aggregates as a mode Service.

Lifecycle and commits
---------------------
Faust supplies the worker, signal handling and the aiohttp web server; its own Kafka consumer and producer are
disabled (`_Boot`), so the worker joins no consumer group of its own. Each sink task runs the batched
confluent-kafka SinkRunner in its own thread (Faust's per-event stream is several times slower; see
docs/architecture.md). On SIGTERM/SIGINT the tasks stop fetching, finish or abandon the in-flight batch, commit
what is done and close; the runners get `shutdown_grace_s - STOP_OVERHEAD_S` so that the whole process, Faust's
own loop shutdown included, exits within `daemon.shutdown_grace_s`. A task or aggregate that stops by itself
(a failure) stops the daemon with exit code 1: fail fast, the supervisor restarts it.

kafold's migrations (`postgres.migrate_on_start`) are applied once here, before any task or aggregate starts,
whenever a hosted connector uses PostgreSQL: every task (thread or child process) then finds kafold's tables,
whatever kind of connector it is. A reload that adds such a connector applies them before starting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import faust
import mode
from faust.app.base import BootStrategy

from kafold import config as kconfig
from kafold import db, devstack, erasure_log, interpreter, logs, protect, sdnotify, tracing
from kafold.config import AggregateConfig, KafoldConfig, Loaded, python_path
from kafold.connectors.api import TopicPartition
from kafold.connectors.projection import restored
from kafold.connectors.registry import instantiate, resolve
from kafold.daemon import connect_api, extensions, http, offsets, signals, status_page, wait_view
from kafold.daemon.aggregates import trust
from kafold.daemon.aggregates.history import Histories
from kafold.daemon.aggregates.routing import StateRouter
from kafold.daemon.metrics import DaemonMetrics
from kafold.daemon.rates import Rates
from kafold.daemon.tasks import AggregateRuntimeView, AggregateSlot, ConnectorGroup, TaskSlot, join_all, task_slots
from kafold.daemon.visibility import Watches
from kafold.errors import ConfigError, FatalError, KafoldError, RetriableError
from kafold.retry import retrying
from kafold.snapshot.scheduler import SnapshotScheduler

log = logs.get(__name__)

MIGRATE_RETRY_S = 30.0  # how long the start waits for PostgreSQL to apply the migrations (as a projection task)
STOP_OVERHEAD_S = 2.0  # Faust/mode's loop shutdown (it gathers tasks and sleeps ~1 s) plus leaving the groups
WATCH_INTERVAL_S = 0.2


class _Boot(BootStrategy):
    """Faust's Kafka consumer/producer off unless users' modules add agents or tables (daemon.extensions): the
    sink tasks and aggregates bring their own batched consumers."""

    enable_kafka = False
    enable_kafka_consumer = False
    enable_kafka_producer = False
    enable_sensors = False

    def stream(self, on: bool) -> None:
        """Faust's Kafka consumer and producer on (for users' agents and tables) or off."""
        self.enable_kafka = self.enable_kafka_consumer = self.enable_kafka_producer = on


class _App(faust.App):
    BootStrategy = _Boot


class _Worker(faust.Worker):
    """Installs signal handlers only in the main thread (the daemon also runs in-process in tests)."""

    def install_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            super().install_signal_handlers()
            early = signals.received()
            if early is not None:  # kept since `kafold daemon` started (daemon.signals): handled as if just sent
                self._schedule_shutdown(early)

    def _schedule_shutdown(self, signal: Any) -> None:  # mode's hook for SIGTERM/SIGINT
        if not self._signal_stop_time:
            log.info("daemon.stop_requested", signal=getattr(signal, "name", str(signal)))
        super()._schedule_shutdown(signal)


class DaemonHost:
    """Builds the connectors, aggregates, metrics and web views of one daemon process; `run` blocks."""

    def __init__(self, cfg: KafoldConfig, base: Path, stop: threading.Event | None = None,
                 config_path: Path | None = None) -> None:
        self.cfg, self.base = cfg, base
        self.stop_event = stop or threading.Event()
        d = cfg.daemon
        self.worker_id = f"{d.http_host}:{d.http_port}"
        self.token = d.api_token.reveal() if d.api_token is not None else None
        # signs and verifies what instances tell each other (state reads sent on, redirects): docs/security.md
        self.instance_key = trust.InstanceKey.of(d)
        self.restart_timeout = d.shutdown_grace_s + 5.0
        self.exit_code = 0
        self.stopping = False
        self.metrics = DaemonMetrics(lambda: self.groups, lambda: self.aggregates, lambda: self.scheduler,
                                     lambda: self.protector)
        self.notifier = sdnotify.Notifier()
        self.rates = Rates()  # records/s and commands/s over the last minute (/status, the status page)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.worker: _Worker | None = None
        self._background: set[Any] = set()
        self.background_stop: Any = None
        self.config_path = config_path
        self._reload_lock = threading.Lock()
        # Protected fields (kafold.protect): built before any reader, so a missing master key stops the start here
        self.protector = protect.build(cfg)
        tracing.configure(cfg.tracing)  # off unless [tracing].enabled (kafold.tracing)
        self.groups = self._build_groups()
        self.aggregates = self._build_aggregates()
        # the objects this daemon keeps for its reads, made with it (the views reach them as host.router & co.)
        self.router = StateRouter(d, self.instance_key, self.call)
        self.watches = Watches(cfg.kafka, cfg.postgres, self.group, self.call)
        self.histories = Histories(cfg, base, self.protector)
        with python_path(cfg, base):
            self.extensions = extensions.load(d.faust_modules)
        # [snapshots] enabled: snapshot jobs as `kafold snapshot run` child processes (the Spark JVM stays out of
        # the daemon), never two at once; needs the config file's path to hand to the child.
        self.scheduler: SnapshotScheduler | None = None
        if cfg.snapshots.enabled and cfg.aggregates and config_path is not None:
            self.scheduler = SnapshotScheduler.from_config(config_path, cfg.snapshots, cfg.kafka, cfg.aggregates)

    def rate_totals(self) -> dict[str, int]:
        """The counts the rates are taken of: records seen per connector, commands handled per aggregate."""
        totals = {f"connector:{g.name}": sum(a.seen for slot in g.slots for a in slot.runner.accounts.values())
                  for g in self.groups}
        for name, slot in self.aggregates.items():
            counts = getattr(slot.runtime, "counts", None)  # as /metrics reads them: a test's stand-in has none
            if counts is not None:
                totals[f"aggregate:{name}"] = int(counts.get("commands", 0))
        return totals

    # ---- building ---------------------------------------------------------------------------------------
    def _build_groups(self, only: set[str] | None = None) -> list[ConnectorGroup]:
        task_daemon = dataclasses.replace(
            self.cfg.daemon, shutdown_grace_s=max(0.0, self.cfg.daemon.shutdown_grace_s - STOP_OVERHEAD_S - 0.5))
        task_pg = dataclasses.replace(self.cfg.postgres, migrate_on_start=False)  # applied here (`migrate`)
        groups: list[ConnectorGroup] = []
        with python_path(self.cfg, self.base):
            for i, settings in enumerate(self.cfg.connectors):
                if only is not None and settings.name not in only:
                    continue
                connector = instantiate(settings, self.base, f"connectors[{i}]")
                if not connector.is_sink():
                    raise FatalError(f"connector {settings.name!r}: the daemon runs sink connectors only")
                slots = task_slots(connector, self.cfg.kafka, task_pg, task_daemon, self.base,
                                   python_path(self.cfg, self.base).paths, self.metrics.observe, self._on_exit,
                                   self.cfg.registry, self.cfg.tracing, self.protector, self._stored)
                groups.append(ConnectorGroup(connector, slots))
        return groups

    def _stored(self, connector: str, checkpoints: Mapping[TopicPartition, int]) -> None:
        """A thread task of `connector` committed `checkpoints` (any thread): wake the waits they cover."""
        self.watches.stored(connector, {(tp.topic, tp.partition): off for tp, off in checkpoints.items()})

    def _build_aggregates(self) -> dict[str, AggregateSlot]:
        if not self.cfg.aggregates:
            return {}
        factory = aggregate_factory()
        with python_path(self.cfg, self.base):
            return {a.name: AggregateSlot(a, factory(self.cfg, a, self.base, self.protector), self._on_exit)
                    for a in self.cfg.aggregates}

    def _build_app(self, datadir: str) -> _App:
        d = self.cfg.daemon
        servers = [s.strip() for s in (self.cfg.kafka.bootstrap_servers or "localhost:9092").split(",") if s]
        app = _App(f"kafold-daemon-{d.group_prefix}", broker=[f"kafka://{s}" for s in servers], datadir=datadir,
                   autodiscover=False, web_enabled=d.http_port != 0, web_bind=d.http_host, web_host=d.http_host,
                   web_port=d.http_port or 8083, web_router_enabled=False, web_tables_enabled=False, loop=self.loop,
                   topic_replication_factor=self.cfg.kafka.replication_factor)
        http.guard_web(app, self)  # the token in front of Faust's own routes too (docs/security.md)
        logs.withhold_request_bytes()  # aiohttp logs a request it cannot parse quoting its header lines
        for path, view in {**http.ROUTES, **connect_api.ROUTES, **wait_view.ROUTES, **status_page.ROUTES}.items():
            app.page(path, name=view.__name__)(type(view.__name__, (view,), {"host": self}))
        app.service(type("KafoldTasks", (TasksService,), {"host": self}))
        installed = extensions.install(app, self.extensions)
        if installed.needs_kafka:
            app.conf.broker_credentials = extensions.broker_credentials(self.cfg.kafka)
        assert isinstance(app.boot_strategy, _Boot)
        app.boot_strategy.stream(installed.needs_kafka)
        if installed.modules:
            log.info("daemon.faust_modules_installed", modules=list(installed.modules), agents=list(installed.agents),
                     tables=list(installed.tables), faust_consumer_group=app.conf.id if installed.needs_kafka else None)
        return app

    # ---- migrations -------------------------------------------------------------------------------------
    def needs_migrations(self, groups: list[ConnectorGroup] | None = None) -> bool:
        """True when `postgres.migrate_on_start` is set and one of `groups` (default: all) uses PostgreSQL."""
        groups = self.groups if groups is None else groups
        return self.cfg.postgres.migrate_on_start and (any(g.connector.uses_postgres for g in groups)
                                                       or any(a.protect for a in self.cfg.aggregates))

    def migrate(self, groups: list[ConnectorGroup] | None = None) -> None:
        """Apply kafold's migrations when `groups` need them, retrying while PostgreSQL is unreachable (up to
        MIGRATE_RETRY_S, or until a stop is requested); raises the error after that."""
        if not self.needs_migrations(groups):
            return

        def warn(e: RetriableError, delay: float) -> None:
            log.warning("daemon.postgres_retrying", step="migrate", error=str(e), retry_in_s=delay)

        revision = retrying(lambda: db.upgrade(self.cfg.postgres), within_s=MIGRATE_RETRY_S, on_retry=warn,
                            stop=self.stop_event)
        log.info("daemon.migrations_applied", schema=self.cfg.postgres.schema, revision=revision)

    def reapply_erasures(self) -> list[str]:
        """With protected fields: re-apply the erasure log before any reader starts (kafold.erasure_log), so a
        database restored from a backup serves no subject forgotten since; retried while Kafka or PostgreSQL is
        unreachable (up to MIGRATE_RETRY_S), then raises: the daemon does not start on a store it cannot check.
        Returns the subjects whose keys it deleted (their restored projection rows: `refresh_restored`)."""
        ring = None if self.protector is None else self.protector.ring
        if ring is None or ring.erasure_log is None:
            return []
        found = ring.erasure_log

        def warn(e: RetriableError, delay: float) -> None:
            log.warning("daemon.erasures_retrying", error=str(e), retry_in_s=delay)

        gone: list[str] = retrying(lambda: erasure_log.reapply(ring, found), within_s=MIGRATE_RETRY_S,
                                   on_retry=warn, stop=self.stop_event)
        self.purge_keys()
        return gone

    def refresh_restored(self, subjects: list[str]) -> None:
        """The rows of `subjects` (whose keys the re-apply deleted) folded again in each projection of protected
        fields, beside the live tasks (each refresh locks the live table for its swap); failures are logged with
        the command to run by hand and the daemon keeps serving (connectors.projection.restored)."""
        restored.refresh_restored(self.cfg, self.base, subjects, self.protector, stop=self.stop_event,
                                  config_file=str(self.config_path or "FILE"))

    def purge_keys(self) -> None:
        """Remove deleted keys' bytes from the key store's files when keys were deleted since the last purge
        (KeyStore.purge); a failure is logged and left to the next interval."""
        if self.protector is None:
            return
        try:
            if self.protector.ring.store.purge():
                log.info("protect.keys_purged", store=self.cfg.privacy.key_store)
        except Exception as e:  # psycopg's errors too (PostgreSQL busy, a schema not migrated yet): not fatal
            log.warning("protect.keys_purge_failed", error=str(e), retry_in_s=self.cfg.privacy.key_purge_interval_s)

    # ---- reload (SIGHUP, POST /reload) --------------------------------------------------------------------
    def reload(self) -> dict[str, list[str]]:
        """Re-read the configuration file and apply its connectors: added ones start, removed ones stop, changed
        ones restart (each stop commits what is done, see daemon.tasks), unchanged ones keep running. An invalid
        file raises ConfigError and changes nothing. Other sections need a restart: they are reported, not applied.
        """
        if self.config_path is None:
            raise KafoldError("this daemon was not started from a configuration file; nothing to reload")
        with self._reload_lock:
            loaded = kconfig.load_file(self.config_path)
            new = devstack.effective(loaded.config, need=services_needed(loaded))
            old = {c.name: c for c in self.cfg.connectors}
            fresh = {c.name: c for c in new.connectors}
            added = [n for n in fresh if n not in old]
            removed = [n for n in old if n not in fresh]
            changed = [n for n in fresh if n in old and fresh[n] != old[n]]
            kept = [n for n in fresh if n in old and fresh[n] == old[n]]
            ignored = [s for s in ("kafka", "postgres", "daemon", "aggregates", "snapshots", "topics")
                       if getattr(new, s) != getattr(self.cfg, s)]
            previous = self.cfg
            self.cfg = dataclasses.replace(self.cfg, connectors=new.connectors)
            try:
                built = {g.name: g for g in self._build_groups(only={*added, *changed})}
            except Exception:
                self.cfg = previous  # nothing was stopped yet
                raise
            self.migrate(list(built.values()))  # before anything stops: a failure changes nothing
            by_name = {g.name: g for g in self.groups}
            leaving = [by_name[n] for n in [*removed, *changed] if n in by_name]
            with contextlib.ExitStack() as held:  # the connectors' control calls wait (daemon.tasks.Control)
                for group in [*leaving, *(built[n] for n in added)]:
                    held.enter_context(group.control.lock)
                for slot in [s for g in leaving for s in g.slots]:
                    slot.stop()
                for slot in [s for g in leaving for s in g.slots]:
                    if not slot.join(self.restart_timeout):
                        log.error("daemon.reload_task_not_stopped", task=slot.name)
                for group in leaving:
                    if group.name in built:
                        built[group.name].adopt(group)
                    else:
                        group.retired = True
                self.groups = [built[n] if n in built else by_name[n] for n in fresh]
                for name in [*added, *changed]:
                    for slot in built[name].slots:
                        slot.start()
            result = {"added": added, "removed": removed, "changed": changed, "unchanged": kept,
                      "needs_restart": ignored}
            log.info("daemon.reloaded", **result)
            if ignored:
                log.warning("daemon.reload_needs_restart", sections=ignored,
                            hint="these sections changed and apply only after a restart")
            return result

    def reload_logged(self) -> None:
        """`reload` for a signal handler: an error is logged; the running configuration stays."""
        try:
            self.reload()
        except ConfigError as e:
            log.error("daemon.reload_refused", problems=e.problems, reason="the configuration file is invalid",
                      hint="the running configuration stays")
        except Exception as e:
            log.error("daemon.reload_failed", error_class=type(e).__name__, error=str(e),
                      hint="the running configuration stays")

    # ---- state ------------------------------------------------------------------------------------------
    @property
    def slots(self) -> list[TaskSlot]:
        return [s for g in self.groups for s in g.slots]

    @property
    def failed(self) -> bool:
        return any(s.failed for s in self.slots) or any(a.failed for a in self.aggregates.values())

    def group(self, name: str) -> ConnectorGroup | None:
        return next((g for g in self.groups if g.name == name), None)

    def ready_report(self) -> tuple[bool, dict[str, Any]]:
        """Ready when every task joined its group and caught up on every assigned partition, and every
        aggregate runtime is live."""
        waiting: list[dict[str, Any]] = []
        for slot in self.slots:
            r = slot.runner
            where = {"connector": slot.connector.name, "task": slot.task_id, "state": slot.state}
            if slot.state not in ("RUNNING", "PAUSED"):
                waiting.append({**where, "reason": "task not running"})
            elif not r.counts["assignments"]:
                waiting.append({**where, "reason": "partitions not assigned yet"})
            else:
                behind = [{"topic": p.tp.topic, "partition": p.tp.partition, "position": p.position,
                           "end_offset_at_assignment": p.target, "lag": p.lag}
                          for p in sorted(r.progress.snapshot.values(), key=lambda p: p.tp) if not p.caught_up]
                if behind:
                    waiting.append({**where, "reason": "catching up", "partitions": behind})
        for agg in self.aggregates.values():
            if not agg.ready:
                stopped = [{"partition": p["partition"], "fold_error": p["fold_error"]}
                           for p in agg.runtime.partitions() if p.get("fold_error")]
                reason = "failed" if agg.failed else "fold error" if stopped else "recovering"
                waiting.append({"aggregate": agg.name, "reason": reason,
                                **({"partitions": stopped} if stopped else {})})
        if self.stopping:
            waiting.append({"reason": "shutting down"})
        ready = not waiting
        return ready, {"ready": ready, "not_ready": waiting,
                       "tasks": len(self.slots), "aggregates": len(self.aggregates)}

    async def group_offsets(self, group: ConnectorGroup) -> dict[tuple[str, int], int]:
        topics = list(group.connector.settings.topics)
        group_id = group.slots[0].runner.group_id if group.slots else ""

        def read() -> dict[TopicPartition, int]:
            return offsets.group_offsets(self.cfg.kafka, group_id, offsets.partitions(self.cfg.kafka, topics))

        found = await self.call(read)
        return {(tp.topic, tp.partition): off for tp, off in found.items()}

    # ---- threads and the loop ---------------------------------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking `fn` in the default executor."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def background(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run blocking `fn` in the executor without waiting (e.g. a task restart requested over HTTP)."""
        assert self.loop is not None
        fut = self.loop.run_in_executor(None, fn, *args)
        self._background.add(fut)
        fut.add_done_callback(self._background.discard)

    def _on_exit(self, worker: TaskSlot | AggregateSlot) -> None:
        """A task or aggregate thread ended by itself (not through stop): fail fast."""
        if self.stopping or worker.stopping:
            return
        log.error("daemon.task_stopped_by_itself", task=worker.name, failed=worker.failed,
                  hint="stopping the daemon (exit 1)")
        self.exit_code = 1
        self.request_stop()

    def request_stop(self) -> None:
        """Thread-safe: ask the worker to stop (as SIGTERM does)."""
        self.stop_event.set()

    def run(self) -> int:
        """Run the Faust worker until SIGTERM/SIGINT, `stop_event` or a failure; the exit code (0 or 1)."""
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        with tempfile.TemporaryDirectory(prefix="kafold-daemon-") as datadir:
            app = self._build_app(datadir)
            self.worker = _Worker(app, loop=self.loop, quiet=True, loglevel="warning", override_logging=False,
                                  redirect_stdouts=False, daemon=True)
            self.worker.spinner = None  # a terminal spinner would interleave with the structured log lines
            try:
                self.worker.execute_from_commandline()
            except SystemExit as e:
                if e.code not in (0, None):
                    self.exit_code = 1
            finally:
                _close_idle_consumer_loop(app)
                self.histories.close()  # the history readers' consumers and connections, if a read made them
                tracing.shutdown()  # export the spans still buffered
        return self.exit_code


def aggregate_factory() -> Callable[[KafoldConfig, AggregateConfig, Path, protect.Protector | None],
                                     AggregateRuntimeView]:
    """`kafold.daemon.aggregates.build_runtime(cfg, aggregate, base, protector)`, imported only when aggregates are
    hosted."""
    from kafold.daemon.aggregates import build_runtime  # lazy: a daemon without aggregates never loads them

    return build_runtime


def services_needed(loaded: Loaded) -> tuple[str, ...]:
    """The services a loaded configuration needs: always Kafka; PostgreSQL when a connector uses it
    (`devstack.effective` fills them in from a running dev stack)."""
    with python_path(loaded.config, loaded.base):
        pg = any(resolve(c.connector_class).uses_postgres for c in loaded.config.connectors)
    return ("kafka", "postgres") if pg else ("kafka",)


def _close_idle_consumer_loop(app: Any) -> None:
    """Close the event loop of Faust's consumer thread, which Faust creates on start even with its consumer off.

    The thread never runs here (the sink tasks bring their own consumers), so nothing closes its loop; left to the
    garbage collector at interpreter exit, the loop's `__del__` can meet its self-pipe already closed and print an
    "Invalid file descriptor" traceback on stderr after a clean stop.
    """
    thread = getattr(getattr(app, "_consumer", None), "_thread", None)
    loop = getattr(thread, "thread_loop", None)
    if isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_running() and not loop.is_closed():
        loop.close()


def _loopback(host: str) -> bool:
    """True for a host name or address that only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TasksService(mode.Service):
    """Starts every sink task and aggregate thread; watches them; stops them within the grace period."""

    host: DaemonHost

    async def on_start(self) -> None:
        if signals.received() is not None:  # stopping already (daemon.signals): start no task only to stop it
            log.info("daemon.start_skipped", reason="stop requested before the tasks started; none started")
            return
        try:
            await self.host.call(self.host.migrate)
            reapplied: list[str] = await self.host.call(self.host.reapply_erasures)
        except Exception as e:  # no task could work without kafold's tables: fail fast
            log.error("daemon.migrations_failed", error_class=type(e).__name__, error=str(e),
                      hint="stopping the daemon (exit 1)")
            self.host.exit_code = 1
            self.host.request_stop()
            return
        if self.host.stop_event.is_set():
            return
        # The daemon's process set up for batch work whatever it hosts (before: only by a projection task in it, so
        # with the projections in processes of their own the webhook threads here ran the GC at Python's defaults).
        interpreter.set_up()
        for slot in self.host.slots:
            slot.start()
        for agg in self.host.aggregates.values():
            agg.start()
        if reapplied:  # a restored database: its projection rows of those subjects are the backup's (clear values)
            self.host.background(self.host.refresh_restored, reapplied)
        log.info("daemon.started", connectors=[g.name for g in self.host.groups], tasks=len(self.host.slots),
                 aggregates=list(self.host.aggregates), http=self.host.worker_id
                 if self.host.cfg.daemon.http_port else None)
        if not self.host.slots and not self.host.aggregates:
            log.warning("daemon.http_only", reason="no connectors or aggregates configured; serving HTTP only")
        try:  # SIGHUP reloads the connectors (systemd: ExecReload); only possible on the main thread's loop
            asyncio.get_running_loop().add_signal_handler(
                signal.SIGHUP, lambda: self.host.background(self.host.reload_logged))
        except (RuntimeError, ValueError, NotImplementedError):
            log.debug("daemon.sighup_reload_unavailable", reason="not the main thread", hint="POST /reload still is")
        d = self.host.cfg.daemon
        if d.http_port and self.host.token is None and not _loopback(d.http_host):
            log.warning("daemon.api_unprotected", http_host=d.http_host,
                        reason="the REST API listens beyond localhost without a token: anyone who can reach it "
                               "can pause, resume and restart connectors", hint="set [daemon] api_token_file")

    @mode.Service.task
    async def _watch(self) -> None:
        """Stop on request or failure; tell systemd READY=1 once caught up, and ping its watchdog."""
        host, notified, last_ping = self.host, False, 0.0
        while not self.should_stop:
            if host.stop_event.is_set() and host.worker is not None:
                log.info("daemon.stop_requested", reason="failure" if host.exit_code else "stop event")
                host.background_stop = asyncio.ensure_future(host.worker.stop())
                return
            for slot in host.slots:
                slot.check_polling()
            if host.rates.due(time.monotonic()):
                host.rates.sample(host.rate_totals(), time.monotonic())
            if not notified and host.ready_report()[0]:
                notified = host.notifier.ready("caught up") or True
            interval = host.notifier.watchdog_interval_s
            if interval and time.monotonic() - last_ping >= interval and not host.failed:
                host.notifier.watchdog()
                last_ping = time.monotonic()
            await self.sleep(WATCH_INTERVAL_S)

    @mode.Service.task
    async def _key_purge_timer(self) -> None:
        """With protected fields: deleted keys' bytes removed from the key store's files every
        `[privacy] key_purge_interval_s` when keys were deleted meanwhile (docs/security.md)."""
        if self.host.protector is None:
            return
        async for _ in self.itertimer(self.host.cfg.privacy.key_purge_interval_s, name="kafold.keys.purge"):
            if self.host.stop_event.is_set():
                return
            await self.host.call(self.host.purge_keys)

    @mode.Service.task
    async def _snapshot_timer(self) -> None:
        """[snapshots]: the scheduler's triggers, checked every `poll_s` off the loop (the new-events count asks
        the broker); a due run starts in its own thread, never while one is in progress (SnapshotScheduler)."""
        sched = self.host.scheduler
        if sched is None:
            return
        async for _ in self.itertimer(sched.poll_s, name="kafold.snapshot.scheduler"):
            if sched.stopped or self.host.stop_event.is_set():
                return
            if sched.busy:
                continue
            reason = await self.host.call(sched.check)
            if reason and not sched.stopped:
                sched.start_run(reason)

    async def on_stop(self) -> None:
        host = self.host
        host.stopping = True
        started = time.monotonic()
        host.notifier.stopping("stopping sink tasks")
        if host.scheduler is not None:
            host.scheduler.stop()  # a snapshot run in progress finishes on its own; it is idempotent
        workers: list[Any] = [*host.slots, *host.aggregates.values()]
        for w in workers:
            w.stop()
        deadline = started + max(0.5, host.cfg.daemon.shutdown_grace_s - STOP_OVERHEAD_S)
        stuck = await host.call(join_all, workers, deadline)
        for g in host.groups:
            try:
                g.connector.stop()
            except Exception as e:
                log.error("daemon.connector_stop_failed", connector=g.name, error=str(e))
        if host.protector is not None and host.protector.ring.erasure_log is not None:
            host.protector.ring.erasure_log.close()  # its producer's threads end with the daemon, not at exit
        failed = [w.name for w in workers if w.failed]
        if stuck:
            log.error("daemon.stop_grace_exceeded", tasks=stuck,
                      reason="tasks did not stop within the grace period", hint="exiting anyway")
        if failed or stuck:
            host.exit_code = 1
        log.info("daemon.stopped", failed=failed, stuck=stuck, exit_code=host.exit_code,
                 stop_s=round(time.monotonic() - started, 2))
