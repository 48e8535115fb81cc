"""`kafold events audit` on Apache Kafka: a clean cart history exits 0 with its counts per event type and schema
version; a history with events today's code cannot decode, upcast, read or fold exits 1 naming type, version and
offset of each; `--json` carries the same report; `--topic` audits another topic with the same aggregate code; the
Spark engine (one task per partition) reports what the in-process one does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kafold import config, topics
from kafold.config import KafkaConfig
from kafold.envelope import Event, encode
from kafold.tools import cli
from tests.support import ROOT, child_env, create_topic, kafka_toml, produce

KAFOLD = str(Path(sys.executable).parent / "kafold")
M = "tests.aggregates.cart_domain"
T0 = "2026-01-05T10:00:00+00:00"
# A legacy type turned into ItemsAdded v2 by a declared step; the step refuses a `kind` it has no type for.
UPCASTERS = """
[[aggregates.upcasters]]
type = "LegacyItems"
from_version = 1
split_on = "kind"
split_types = { bulk = "ItemsAdded" }
remove_fields = ["kind"]
"""


def _config(path: Path, kafka: KafkaConfig, unique: str) -> Path:
    path.write_text(f"""
{kafka_toml(kafka)}
[daemon]
group_prefix = "{unique}"
python_path = ["{ROOT}"]

[[aggregates]]
name = "cart"
initial = "{M}:initial"
evolve = "{M}:evolve"
decide = "{M}:decide"
partitions = 2
events_topic = "{unique}.events"
commands_topic = "{unique}.commands"
results_topic = "{unique}.results"
snapshot_topic = "{unique}.snapshots"
{UPCASTERS}
""")
    topic_map = config.topic_map(config.load_file(path).config)
    assert topics.ensure(kafka, topic_map.values()).ok
    return path


def _event(type_name: str, cart: str, version: int, payload: dict[str, Any], schema_version: int = 1,
           partition: int = 0) -> tuple[int, bytes, bytes, Any]:
    ev = Event.new(type_name, "cart", cart, version, payload, schema_version=schema_version)
    return (partition, *encode(ev))


def _items(*prices: str) -> dict[str, Any]:
    return {"skus": [f"s{i}" for i in range(len(prices))],
            "lines": [{"sku": f"s{i}", "price": p} for i, p in enumerate(prices)]}


def _audit(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what the set-up printed
    code = cli.main(["--log-format", "json", "events", "audit", "--no-progress", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out: str) -> dict[tuple[str, str], list[str]]:
    """The table's rows: (type, version) -> the figures (events, ok, decode, upcast, read, fold)."""
    rows = {}
    for line in out.splitlines():
        cols = line.split()
        if len(cols) == 8 and cols[2].replace(",", "").isdigit():
            rows[(cols[0], cols[1])] = cols[2:]
    return rows


CLEAN = [
    _event("CartOpened", "c1", 1, {"opened_at": T0}),
    _event("ItemsAdded", "c1", 2, _items("1.10", "2.20")),
    _event("CheckedOut", "c1", 3, {"at": T0, "total": "3.30"}),
    _event("CartOpened", "c2", 1, {"opened_at": T0}, partition=1),
    _event("LegacyItems", "c2", 2, {**_items("5"), "kind": "bulk"}, partition=1),  # upcast to ItemsAdded v2
]


BAD = [
    _event("CartOpened", "c9", 1, {"opened_at": T0}),                          # 0:0 ok
    _event("ItemsAdded", "c9", 2, _items("lots")),                             # 0:1 read: price no Decimal
    (0, b"c9", b"\x00not json at all", None),                                  # 0:2 decode
    _event("ItemsAdded", "c9", 3, _items("1")),                                # 0:3 ok
    _event("ItemsAdded", "c9", 4, _items()),                                   # 0:4 fold: evolve raises
    _event("LegacyItems", "c9", 5, {**_items("2"), "kind": "loose"}),          # 0:5 upcast: no such kind
    _event("CartRenamed", "c9", 6, {"name": "x"}, schema_version=3),           # 0:6 read: unknown type
    _event("ItemsAdded", "c8", 1, _items("1"), partition=1),                   # 1:0 ok
]


@pytest.mark.timeout(300)
def test_a_clean_history_exits_0_with_counts_per_type_and_version(kafka_config: KafkaConfig, unique: str,
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    conf = _config(tmp_path / "kafold.toml", kafka_config, unique)
    produce(kafka_config, f"{unique}.events", CLEAN)
    code, out, err = _audit(capsys, "-c", str(conf))
    assert code == 0, out + err
    assert f"{unique}.events (aggregate cart): 5 events in 2 partitions, 0 not readable" in out, out
    assert _rows(out) == {("CartOpened", "1"): ["2", "2", "0", "0", "0", "0"],
                          ("CheckedOut", "1"): ["1", "1", "0", "0", "0", "0"],
                          ("ItemsAdded", "1"): ["1", "1", "0", "0", "0", "0"],
                          ("LegacyItems", "1"): ["1", "1", "0", "0", "0", "0"]}, out
    assert "FAILED" not in out
    done = [json.loads(line) for line in err.splitlines() if '"events.audit_done"' in line]
    assert done and done[0]["events"] == 5 and done[0]["failed"] == 0, err


@pytest.mark.timeout(300)
def test_events_the_code_cannot_read_exit_1_naming_type_version_and_offset(kafka_config: KafkaConfig, unique: str,
                                                                          tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    conf = _config(tmp_path / "kafold.toml", kafka_config, unique)
    produce(kafka_config, f"{unique}.events", BAD)

    code, out, err = _audit(capsys, "-c", str(conf))
    assert code == 1, out + err
    assert _rows(out) == {("CartOpened", "1"): ["1", "1", "0", "0", "0", "0"],
                          ("CartRenamed", "3"): ["1", "0", "0", "0", "1", "0"],
                          ("ItemsAdded", "1"): ["4", "2", "0", "0", "1", "1"],
                          ("LegacyItems", "1"): ["1", "0", "0", "1", "0", "0"],
                          ("?", "?"): ["1", "0", "1", "0", "0", "0"]}, out
    assert "FAILED ItemsAdded v1 at 0:1 (read): UnreadableEvent: event ItemsAdded: field 'lines[0].price'" in out
    assert "FAILED ItemsAdded v1 at 0:4 (fold): IndexError" in out, out
    assert "FAILED LegacyItems v1 at 0:5 (upcast): UpcastError: upcasting LegacyItems v1 failed" in out, out
    assert "FAILED CartRenamed v3 at 0:6 (read): UnreadableEvent: unknown event type 'CartRenamed'" in out, out
    assert "FAILED ? v? at 0:2 (decode)" in out, out
    complaints = [line for line in err.splitlines() if line.startswith("cart: ")]
    assert len(complaints) == 4, complaints  # CartRenamed, ItemsAdded, LegacyItems, the record that is no event
    assert complaints[1].startswith(f"cart: ItemsAdded v1: 2 of 4 events fail (1 read, 1 fold); first at "
                                    f"{unique}.events 0:1: UnreadableEvent"), complaints
    assert complaints[3].startswith(f"cart: ? v?: 1 of 1 events fail (1 decode); first at {unique}.events 0:2: "
                                    "DecodeError: JSON is malformed"), complaints

    code, out, err = _audit(capsys, "-c", str(conf), "--json")
    assert code == 1, out + err
    report = json.loads(out)
    assert report["ok"] is False
    (cart,) = report["aggregates"]
    assert (cart["aggregate"], cart["topic"], cart["partitions"]) == ("cart", f"{unique}.events", 2)
    assert (cart["events"], cart["ok"], cart["failed"]) == (8, 3, 5), cart
    by_type = {(t["type"], t["schema_version"]): t for t in cart["types"]}
    items = by_type[("ItemsAdded", 1)]
    assert items["failed"] == {"decode": 0, "upcast": 0, "read": 1, "fold": 1}, items
    assert [(f["partition"], f["offset"], f["stage"]) for f in items["first_failures"]] == [(0, 1, "read"),
                                                                                              (0, 4, "fold")]
    assert "Invalid decimal string" in items["first_failures"][0]["error"], items
    unknown = by_type[("?", "?")]
    assert unknown["events"] == 1 and unknown["first_failures"][0]["offset"] == 2, unknown
    assert by_type[("LegacyItems", 1)]["failed"]["upcast"] == 1


@pytest.mark.timeout(300)
def test_another_topic_and_usage_errors(kafka_config: KafkaConfig, unique: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    conf = _config(tmp_path / "kafold.toml", kafka_config, unique)
    create_topic(kafka_config, f"{unique}.archive", partitions=3)
    produce(kafka_config, f"{unique}.archive", [_event("CartOpened", "c1", 1, {"opened_at": T0}, partition=2)])
    code, out, err = _audit(capsys, "-c", str(conf), "--topic", f"{unique}.archive", "--json")
    assert code == 0, out + err
    (cart,) = json.loads(out)["aggregates"]
    assert (cart["topic"], cart["partitions"], cart["events"], cart["failed"]) == (f"{unique}.archive", 3, 1, 0)

    code, out, err = _audit(capsys, "-c", str(conf), "--aggregate", "nope")
    assert code == 2 and "no aggregate named 'nope'" in err, err
    code, out, err = _audit(capsys, "-c", str(conf), "--topic", f"{unique}.missing")
    assert code == 1 and f"topic '{unique}.missing' does not exist" in err, err


@pytest.mark.timeout(600)
def test_the_spark_engine_reports_what_the_local_one_does(kafka_config: KafkaConfig, unique: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pyspark")
    conf = _config(tmp_path / "kafold.toml", kafka_config, unique)
    produce(kafka_config, f"{unique}.events", BAD)
    code, out, err = _audit(capsys, "-c", str(conf), "--json", "--engine", "local")
    assert code == 1, out + err
    local = json.loads(out)
    # Spark in a child process: its JVM stays out of the test process.
    run = subprocess.run([KAFOLD, "--log-format", "json", "events", "audit", "-c", str(conf), "--json",
                          "--engine", "spark", "--master", "local[2]"],
                         capture_output=True, text=True, timeout=500, env=child_env())
    assert run.returncode == 1, run.stdout + run.stderr[-3000:]
    spark = json.loads(run.stdout)
    assert [a["engine"] for a in spark["aggregates"]] == ["spark"] and local["aggregates"][0]["engine"] == "local"
    for report in (local, spark):
        for a in report["aggregates"]:
            del a["engine"], a["duration_s"]
    assert spark == local
    assert "cart: ItemsAdded v1: 2 of 4 events fail (1 read, 1 fold)" in run.stderr, run.stderr[-3000:]
