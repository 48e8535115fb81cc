"""Users' Faust modules (`[daemon] faust_modules`): their agents, timers and pages in the daemon's worker.

A module named in `faust_modules` defines `setup(app)`; the daemon calls it on its Faust app before the worker
starts, so the module registers agents (`@app.agent`), tables, timers (`@app.timer`), services and web pages
(`@app.page`, behind the API token like every route: daemon.http.token_guard) the Faust way.

Kafka and commits
-----------------
kafold's own tasks consume with confluent-kafka (docs/architecture.md); Faust's Kafka consumer and producer are
started only when a module registered an agent or a table, so a daemon without such modules joins no consumer
group of its own. When they run, Faust's consumer group is the app id `kafold-daemon-<group_prefix>` and Faust
commits its agents' offsets itself (at least once, Faust's `broker_commit_every` / `broker_commit_interval`);
kafold's exactly-once and dead-letter guarantees cover kafold's connectors and aggregates, not a user's agents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import faust

from kafold.config import KafkaConfig
from kafold.errors import ConfigError
from kafold.kafka_clients import aiokafka_kwargs
from kafold.refs import import_ref

Setup = Callable[[faust.App], Any]


def load(modules: Sequence[str]) -> list[tuple[str, Setup]]:
    """Each module's `setup` (python_path already on sys.path); a ConfigError naming `daemon.faust_modules[i]` for
    one that does not import or has no callable `setup(app)` (the loader checks the same: kafold.config)."""
    found: list[tuple[str, Setup]] = []
    problems: list[str] = []
    for i, name in enumerate(modules):
        try:
            found.append((name, import_ref(f"{name}:setup", callable_=True)))
        except LookupError as e:
            problems.append(f"daemon.faust_modules[{i}]: {e}")
    if problems:
        raise ConfigError(problems)
    return found


@dataclass(frozen=True)
class Installed:
    """What the modules registered on the app: Faust's Kafka consumer runs only for agents or tables."""

    modules: tuple[str, ...]
    agents: tuple[str, ...]
    tables: tuple[str, ...]

    @property
    def needs_kafka(self) -> bool:
        return bool(self.agents or self.tables)


def install(app: faust.App, setups: Sequence[tuple[str, Setup]]) -> Installed:
    """Call every module's `setup(app)`; a ConfigError naming the module when one raises."""
    for i, (name, setup) in enumerate(setups):
        try:
            setup(app)
        except Exception as e:
            raise ConfigError([f"daemon.faust_modules[{i}]: {name}.setup(app) raised {type(e).__name__}: {e}"]) \
                from e
    return Installed(tuple(name for name, _ in setups), tuple(sorted(app.agents)), tuple(sorted(app.tables)))


def broker_credentials(kafka: KafkaConfig) -> faust.types.auth.CredentialsT | None:
    """[kafka]'s security settings as Faust credentials (from the one aiokafka mapping, kafka_clients), so users'
    agents reach the brokers kafold reaches."""
    if kafka.security_protocol == "PLAINTEXT":
        return None
    kw = aiokafka_kwargs(kafka)
    if kafka.security_protocol == "SSL":
        return faust.SSLCredentials(kw["ssl_context"])
    if kafka.sasl_mechanism == "OAUTHBEARER":
        raise ConfigError(["daemon.faust_modules: Faust agents cannot use kafka.sasl_mechanism = 'OAUTHBEARER' "
                           "(Faust's transport is given no token provider)"])
    return faust.SASLCredentials(username=kw.get("sasl_plain_username"), password=kw.get("sasl_plain_password"),
                                 ssl_context=kw.get("ssl_context"), mechanism=kw["sasl_mechanism"])
