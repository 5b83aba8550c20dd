"""Bench: one commit's cost as a table's Delta log ages: no Spark, no Kafka, no Dagster.

    python bench/bench_commits.py                    # a log of 3,000 commits (30 days of 15-minute slices)
    python bench/bench_commits.py --n 500 --commits 10

A slice commits to each table it writes, so what a commit costs beyond writing its log entry is
paid ~20 times a slice (whole graph). Ages a local table by `--n` empty commits (a checkpoint
every `storage.CHECKPOINT_INTERVAL`), then times `--commits` commits each way, alternating:
`DeltaRsEngine.commit` (which leaves expired log files to `lake_maintenance`) and delta-rs's
default commit, which lists the whole log for them each time. Both include bringing the handle
up to date, as the engine does to learn the committed version. The last line is
machine-readable key=value pairs; times are medians in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import pyarrow as pa
from common import kv_line, log  # puts the repository on the path
from deltalake import DeltaTable

from entity_assets.storage import DeltaRsEngine

SCHEMA = pa.schema([("slice", pa.string())])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="commits that age the table's log")
    parser.add_argument("--commits", type=int, default=20, help="commits timed each way")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-commits-") as root:
        engine = DeltaRsEngine(root)
        engine.ensure("t", SCHEMA)
        dt = DeltaTable(engine.uri("t"))  # a handle of the bench's own, for delta-rs's default commits
        log(f"ageing the log by {args.n:,} commits")
        t0 = time.perf_counter()
        while dt.version() < args.n:
            dt.create_write_transaction([], "append", SCHEMA)
            dt.update_incremental()
        log(f"aged in {time.perf_counter() - t0:.1f}s: {len(os.listdir(f'{root}/t/_delta_log')):,} log files")

        def engine_commit(i: int) -> None:
            engine.commit("t", SCHEMA, add=[], operation="bench", slice_key=f"{i:010d}")

        def default_commit(_: int) -> None:
            dt.update_incremental()
            dt.create_write_transaction([], "append", SCHEMA)
            dt.update_incremental()

        times: dict[str, list[float]] = {"engine": [], "default": []}
        for i in range(args.commits):
            for name, commit in (("engine", engine_commit), ("default", default_commit)):
                t0 = time.perf_counter()
                commit(i)
                times[name].append((time.perf_counter() - t0) * 1000)
        files = len(os.listdir(f"{root}/t/_delta_log"))
        engine_ms, default_ms = (statistics.median(times[k]) for k in ("engine", "default"))
        log(f"{files:,} log files: a commit {engine_ms:.1f} ms (the engine's), {default_ms:.1f} ms (delta-rs's default)")
    print(kv_line(n=args.n, log_files=files, commits=args.commits, engine_ms=engine_ms, default_ms=default_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
