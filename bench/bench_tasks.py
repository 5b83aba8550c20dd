"""Bench: the entity core's task bodies in one process, CPU per patch: no Spark, no Kafka, no Dagster.

    python bench/bench_tasks.py                      # 100,000 patches over 10,000 entities, 5 rounds
    python bench/bench_tasks.py --n 20000 --rounds 3

Runs what the Spark tasks of `entity_patches`, `apply_patches` and `zone_changes` run, on
local parquet files: `fold.explode_task` over `entity_batches` rows, `fold.fold_task` over
the patches it wrote (every state bucket, empty state), `fold.zone_changes_task` over the updates.
Each spools its messages to an outbox as in a run; nothing is produced to Kafka (the replay
costs about 2.2 us per message on its own). The pipeline bench's CPU figures move with the
host's load by more than a change of a few microseconds per patch; these bodies, timed alone
over several rounds, show it. The last line is machine-readable key=value pairs with the
median and the minimum over the rounds, in microseconds of this process's CPU per patch.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
from common import kv_line, log  # puts the repository on the path

from entity_assets import core, fold, samples
from entity_assets.publish import Publishing
from entity_assets.storage import from_rows
from entity_assets.tables import SCHEMAS

PUBLISHED = ("entity_patches", "entity_updates", "partial_responses", "complete_responses", "schema_learning",
             "zone_changes")
TABLES = ("entity_patches", "entities", *PUBLISHED[1:])


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def batch_rows(n: int, entities: int) -> pa.Table:
    """entity_batches rows of `BatchTraffic`, as ingest writes them."""
    rows = []
    for offset, (topic, _, value) in enumerate(samples.BatchTraffic(patches=n, entities=entities).records()):
        b = json.loads(value)
        rows.append({"slice": "0000000001", "kafka_topic": topic, "kafka_partition": 0, "kafka_offset": offset,
                     "kafka_timestamp": b["begun"], "clientid": b["clientid"], "request": b["request"],
                     "user": b["user"], "dbid": b["dbid"], "begun": b["begun"], "parts": len(b["patches"]),
                     "patches": core.dumps(b["patches"]), "learning": b["learning"],
                     "includeBefore": b["includeBefore"], "includeAfter": b["includeAfter"]})
    return pa.Table.from_batches([from_rows(rows, pa.struct(list(SCHEMAS["entity_batches"])))])


def one_round(root: Path, batches: pa.Table, n: int) -> dict[str, float]:
    for table in (*TABLES, "outbox"):
        shutil.rmtree(root / table, ignore_errors=True)
        (root / table).mkdir()
    uris = {t: str(root / t) for t in TABLES}
    publishing = Publishing({}, {t: (t.replace("_", "-"), 4) for t in PUBLISHED}, str(root / "outbox"))
    common = {"slice_key": "0000000001", "uris": uris, "storage_options": None, "publishing": publishing}
    spent = {}

    start = cpu_s()
    [report] = fold.explode_task(iter(batches.to_batches(max_chunksize=20_000)), redelivered=frozenset(),
                                 **{**common, "publishing": None})  # the fold publishes entity-patches
    spent["explode"] = cpu_s() - start
    patches = [f"{uris['entity_patches']}/{r['path']}" for r in report.to_pylist() if r["table"] == "entity_patches"]

    start = cpu_s()
    written = list(fold.fold_task(iter([{"buckets": list(range(core.STATE_BUCKETS))}]), patch_files=patches,
                                  state_files={}, write_state=True, **common))
    spent["fold"] = cpu_s() - start
    updates = [f"{uris['entity_updates']}/{r['path']}" for r in written if r["table"] == "entity_updates"]

    start = cpu_s()
    list(fold.over_files(iter([{"files": updates}]), body=fold.zone_changes_task, **common))
    spent["copy"] = cpu_s() - start
    return {step: 1e6 * s / n for step, s in spent.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100_000, help="patches (one per batch, three ops each)")
    parser.add_argument("--entities", type=int, default=None, help="entities; default n // 10")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    batches = batch_rows(args.n, args.entities or max(1, args.n // 10))
    rounds = []
    with tempfile.TemporaryDirectory(prefix="entity-assets-bench-tasks-") as root:
        for i in range(args.rounds):
            rounds.append(one_round(Path(root), batches, args.n))
            log(f"round {i + 1}: " + ", ".join(f"{step} {us:.1f} us/patch" for step, us in rounds[-1].items()))
    steps = rounds[0].keys()
    print(kv_line(n=args.n, rounds=args.rounds,
                  **{f"{step}_us": statistics.median(r[step] for r in rounds) for step in steps},
                  **{f"{step}_min_us": min(r[step] for r in rounds) for step in steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
