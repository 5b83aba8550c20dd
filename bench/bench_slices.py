"""Bench: small slices after a large state, the way a sensor-driven deployment runs most of the time.

    python bench/bench_slices.py                                 # 300,000 entities, then 4 slices of 100 patches
    python bench/bench_slices.py --n 1000000 --entities 1000000  # a larger store
    python bench/bench_slices.py --n 100000 --entities 10000 --devices 2000   # the whole graph

One slice of N patches builds the state (its time is printed, not the point), then each small
slice spreads `--slice-size` patches over as many new entities, which touches about every state
bucket. Prints each small slice's time per step and, last, machine-readable key=value pairs with
the median slice time and the median of each step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from bench_pipeline import CORE_STEPS, produce
from common import BenchEnv, Timer, driver_peak_mb, kv_line, log, step_seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=300_000, help="patches of the slice that builds the state")
    parser.add_argument("--entities", type=int, default=None, help="entities of that slice; default n")
    parser.add_argument("--devices", type=int, default=0, help="> 0: the whole graph with this many devices")
    parser.add_argument("--slices", type=int, default=4, help="small slices timed after it")
    parser.add_argument("--slice-size", type=int, default=100, help="patches per small slice")
    parser.add_argument("--state-file-rows", type=int, default=None,
                        help="LakeResource.state_file_rows (default the definitions')")
    parser.add_argument("--keep", action="store_true", help="keep the temporary home (lake, broker data)")
    args = parser.parse_args(argv)
    if args.state_file_rows:
        os.environ["ENTITY_ASSETS_STATE_FILE_ROWS"] = str(args.state_file_rows)
    entities = args.entities or args.n
    graph = args.devices > 0
    steps = None if graph else CORE_STEPS
    with BenchEnv(keep=args.keep) as env:
        produce(env, args.n, entities, args.devices, graph, 7)
        from entity_assets.cli import run_pending
        from entity_assets.definitions import build_resources

        build_resources()["spark"].session().range(1).count()  # Spark start, excluded
        with Timer() as big:
            if not all(r["success"] for r in run_pending(steps=steps, log=log)):
                log("the state slice FAILED")
                return 1
        log(f"state: {args.n:,} patches over {entities:,} entities in {big.s:.1f}s")
        times, by_step, rewritten = [], {}, []
        lake = build_resources()["lake"].open()
        state = {f.path: f for f in lake.files("entities")}
        for i in range(args.slices):
            produce(env, args.slice_size, args.slice_size, 0, graph, 100 + i)
            with Timer() as t:
                runs = run_pending(steps=steps, log=lambda *_: None)
            if not all(r["success"] for r in runs):
                log(f"small slice {i + 1} FAILED")
                return 1
            times.append(t.s)
            steps_s = step_seconds(runs)
            for step, sec in steps_s.items():
                by_step.setdefault(step, []).append(sec)
            before, state = state, {f.path: f for f in lake.files("entities")}
            new = [f for p, f in state.items() if p not in before]
            rewritten.append(sum(f.rows for f in new))
            log(f"small slice {i + 1}: {t.s:.2f}s " + ", ".join(f"{k} {v:.2f}s" for k, v in steps_s.items())
                + f"; entities rows written {rewritten[-1]:,} of {sum(f.rows for f in state.values()):,}"
                  f" ({len(new)} of {len(state)} files)")
    print(kv_line(n=args.n, entities=entities, devices=args.devices, slice_size=args.slice_size, slices=args.slices,
                  state_s=round(big.s, 1), median_s=round(statistics.median(times), 2),
                  state_file_rows=build_resources()["lake"].state_file_rows,
                  rewritten_rows=round(statistics.median(rewritten)),
                  peak_driver_mb=round(driver_peak_mb()),
                  **{f"{k}_s": round(statistics.median(v), 2) for k, v in by_step.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
