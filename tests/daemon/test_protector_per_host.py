"""Each daemon host owns the Protector of its own configuration and hands it down (kafold.protect): two daemons in
one process, and a command beside them, read protected fields with their own keys, never with another's."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest

from kafold import config, protect
from kafold.connectors.api import RawRecord, SinkRecord
from kafold.connectors.intake import Intake
from kafold.daemon.host import DaemonHost
from kafold.daemon.tasks import ProcessTaskSlot
from kafold.envelope import Event, decode, encode
from kafold.protect import PREFIX, Protector
from tests.support import ROOT

PROTECTED = "tests.aggregates.test_protect_daemon"
EMAIL = "ann.secret@example.com"


def _toml(name: str, keys: Path, task_processes: bool = False) -> str:
    """A daemon's configuration (no broker is reached: nothing is run) whose `customer` aggregate protects the email
    of `Registered`, under the master key in KF_HOST_<NAME>, its keys in `keys`, its placeholder `[<name>-erased]`."""
    return f"""
[kafka]
bootstrap_servers = "127.0.0.1:9"
[daemon]
http_port = 0
python_path = ["{ROOT}"]
task_processes = {str(task_processes).lower()}
[privacy]
master_key_env = "KF_HOST_{name.upper()}"
placeholder = "[{name}-erased]"
key_store = "directory"
key_store_dir = "{keys}"
[[aggregates]]
name = "customer"
initial = "{PROTECTED}:initial"
evolve = "{PROTECTED}:evolve"
decide = "{PROTECTED}:decide"
partitions = 1
[[aggregates.protect]]
type = "Registered"
fields = ["email"]
[[connectors]]
name = "log-{name}"
class = "log"
topics = ["customer.events"]
"""


def _host(tmp_path: Path, name: str, **kw: Any) -> DaemonHost:
    path = tmp_path / f"{name}.toml"
    path.write_text(_toml(name, tmp_path / f"keys-{name}", **kw))
    loaded = config.load_file(path)
    return DaemonHost(loaded.config, loaded.base, config_path=path)


class _Message:
    """A consumed record as confluent-kafka hands it over."""

    def __init__(self, event: Event) -> None:
        self._key, self._value, self._headers = encode(event)

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> Any:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)


def _read_by_sink(protector: Protector | None, m: _Message) -> Any:
    """The email of `m` as a sink task gets it: through the intake its runner builds (SinkRunner.handle_batch),
    with `protector`, the one its task config was handed."""
    record = Intake("log", lambda _t: True, "dead-letter", protector=protector).record(
        m, "customer.events", 0, 0)  # type: ignore[arg-type]
    assert record is not None
    return record.event.payload["email"]


def _read_by_aggregate(host: DaemonHost, sealed: dict[str, Any]) -> Any:
    """The email of a sealed payload as the host's aggregate runtime folds it (its domain's unseal)."""
    runtime: Any = host.aggregates["customer"].runtime
    assert runtime.domain.protector is host.protector and runtime.domain.unseal is not None
    return runtime.domain.unseal("Registered", "c-1", sealed)["email"]


def test_two_daemons_and_a_command_in_one_process_each_read_with_their_own_protector(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KF_HOST_A", base64.b64encode(os.urandom(32)).decode())
    monkeypatch.setenv("KF_HOST_B", base64.b64encode(os.urandom(32)).decode())
    # task processes: the daemon's own process makes no Kafka client until it runs (a unit test reaches no broker)
    a = _host(tmp_path, "a", task_processes=True)
    b = _host(tmp_path, "b", task_processes=True)  # built after a: nothing of a's is replaced
    assert isinstance(a.protector, Protector) and isinstance(b.protector, Protector)
    assert a.protector is not b.protector
    children = []
    for host in (a, b):  # handed down with each task's config; a task process is sent its host's settings (its
        slot = host.groups[0].slots[0]  # child builds its own from them: daemon.task_process)
        assert isinstance(slot, ProcessTaskSlot) and slot.task_config.protector is host.protector
        assert slot.spec.protect is not None and slot.spec.protect == protect.setup(host.cfg) == host.protector.setup
        children.append(protect.build_setup(slot.spec.protect))
    a_task, b_task = (h.groups[0].slots[0].task_config.protector for h in (a, b))

    sealed = a.protector.seal("customer", "Registered", "c-1", {"email": EMAIL})
    assert sealed["email"].startswith(PREFIX)
    m = _Message(Event.new("Registered", "customer", "c-1", 1, sealed))
    # a's readers open it; b's (another master key, another key store: no key of c-1) read b's placeholder
    for a_sink in (a_task, children[0]):
        assert _read_by_sink(a_sink, m) == EMAIL
    for b_sink in (b_task, children[1]):
        assert _read_by_sink(b_sink, m) == "[b-erased]"
    assert _read_by_aggregate(a, sealed) == EMAIL and _read_by_aggregate(b, sealed) == "[b-erased]"

    # commands in the same process build their own (one of b's configuration, one of a configuration that protects
    # nothing), and the daemons go on with theirs: the intakes their runners build afterwards still open
    command = protect.build(b.cfg)
    assert command is not None and command is not b.protector and command is not a.protector
    assert protect.build(config.parse("", tmp_path / "plain.toml", {}).config) is None
    assert a.groups[0].slots[0].task_config.protector is a.protector and _read_by_sink(a_task, m) == EMAIL
    assert _read_by_aggregate(a, sealed) == EMAIL

    # a copy of the opened event made without its source (a dead letter) is sealed again by the task's, and opens
    opened = Event.new("Registered", "customer", "c-1", 1, {"email": EMAIL})
    raw = RawRecord.of(SinkRecord("customer.events", 0, 0, "c-1", opened), a_task)
    assert EMAIL.encode() not in (raw.value or b"")
    assert a.protector.event(decode(raw.key, raw.value, list(raw.headers))).payload["email"] == EMAIL
