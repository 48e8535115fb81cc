"""`make chaos`: the long chaos run (default 30 minutes, >= 200 faults, >= 1M events); prints the report.

    python -m tests.chaos.run_chaos [--minutes 30] [--fault-every 3] [--items-per-s 900] [--commands-per-s 40]
                                    [--broker tansu|kafka]

`--broker kafka` runs it on a three-node Apache Kafka cluster (replication 3, min ISR 2) and adds the broker
faults: kill -9 of a broker, of a partition leader, a paused controller and all three nodes restarted, injected by
a lane of their own (with the broker pauses) that overlaps the other kinds' lane.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tests.chaos.chaos_harness import Chaos


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--fault-every", type=float, default=3.0, help="seconds between faults (on average)")
    p.add_argument("--items-per-s", type=int, default=900)  # >= 1M events in 30 minutes (with the commands' events)
    p.add_argument("--commands-per-s", type=int, default=40)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--broker", choices=("tansu", "kafka"), default="tansu",
                   help="the embedded tansu, or a three-node Apache Kafka cluster with broker faults")
    p.add_argument("--no-spark", action="store_true", help="leave out the Spark snapshot jobs (snapshot-kill)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kafold-chaos-"))
    print(f"chaos run: {args.minutes:g} min on {args.broker}, work directory {workdir}", flush=True)
    started = time.monotonic()
    spark = shutil.which("java") is not None and not args.no_spark
    chaos = Chaos(workdir, seed=args.seed, pause_s=(5.0, 30.0), spark=spark, broker=args.broker)
    try:
        chaos.run(seconds=args.minutes * 60, fault_every_s=args.fault_every, items_per_s=args.items_per_s,
                  commands_per_s=args.commands_per_s, broker_lane=args.broker == "kafka")
        # A backlog left by the faults (the effects fall behind under load) is worked off for up to 30 minutes more
        # as long as it shrinks; a consumer that stops moving for a minute after the first 10 is a violation.
        report = chaos.check(settle_timeout=600, while_progressing_s=1800)
        if args.broker == "kafka":
            report.violations += chaos.strict_violations()
    finally:
        chaos.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(report.text())
    print(f"wall time {time.monotonic() - started:.0f} s")
    return 0 if not report.violations else 1


if __name__ == "__main__":
    sys.exit(main())
