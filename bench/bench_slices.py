"""Bench: small slices after a large state, the way a sensor-driven deployment runs most of the time.

    python bench/bench_slices.py                                 # 300,000 entities, then 4 slices of 100 patches
    python bench/bench_slices.py --n 1000000 --entities 1000000  # a larger store
    python bench/bench_slices.py --n 100000 --entities 10000 --devices 2000   # the whole graph
    python bench/bench_slices.py --n 20000 --process-per-slice connect   # each slice a run process, as the daemon
    python bench/bench_slices.py --n 20000 --lake s3 --rtt-ms 20  # the lake on S3, 20 ms a request

One slice of N patches builds the state (its time is printed, not the point), then each small
slice spreads `--slice-size` patches over as many new entities, which touches about every state
bucket. Prints each small slice's time per step, the time of `entity-assets history` of a few
entities, and, last, machine-readable key=value pairs with the median slice time, the median of
each step and of the histories (`history_s`).

`--process-per-slice` runs each small slice as the daemon does, in a process of its own
(`entity-assets run`) that starts its Dagster run from nothing: on its own local Spark (`local`,
a JVM per run), or on a Spark Connect server started once before them (`connect`, what
scripts/ui.sh gives the daemon's runs). The time is the whole process's; steps are not split.

`--lake s3` puts the lake in a bucket of moto's S3 server (the `dev` set-up's), reached through
`local_stores.LatencyProxy`, which holds each request for `--rtt-ms`: what an object store's
round trips cost a slice, which loopback alone does not show. `--request-log FILE` has the proxy
write each request's time and first line, to see which of them wait one after the other.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys

from bench_pipeline import CORE_STEPS, produce
from common import BenchEnv, Timer, driver_peak_mb, kv_line, log, step_seconds

from entity_assets.local_service import free_port


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=300_000, help="patches of the slice that builds the state")
    parser.add_argument("--entities", type=int, default=None, help="entities of that slice; default n")
    parser.add_argument("--devices", type=int, default=0, help="> 0: the whole graph with this many devices")
    parser.add_argument("--slices", type=int, default=4, help="small slices timed after it")
    parser.add_argument("--slice-size", type=int, default=100, help="patches per small slice")
    parser.add_argument("--state-file-rows", type=int, default=None,
                        help="LakeResource.state_file_rows (default the definitions')")
    parser.add_argument("--process-per-slice", choices=["local", "connect"], default=None,
                        help="run each small slice in a new process, on its own local Spark or on a Spark Connect server")
    parser.add_argument("--lake", choices=["local", "s3"], default="local",
                        help="the lake in the home's folder, or in a bucket of a local S3 server")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="with --lake s3: milliseconds added to each request")
    parser.add_argument("--request-log", default="",
                        help="with --lake s3: append each request's time, connection and first line to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary home (lake, broker data)")
    args = parser.parse_args(argv)
    if args.state_file_rows:
        os.environ["ENTITY_ASSETS_STATE_FILE_ROWS"] = str(args.state_file_rows)
    entities = args.entities or args.n
    graph = args.devices > 0
    steps = None if graph or args.process_per_slice else CORE_STEPS  # a run process runs the whole job
    with BenchEnv(keep=args.keep) as env, contextlib.ExitStack() as stores:
        if args.lake == "s3":
            s3_lake(env, args.rtt_ms, stores, args.request_log)
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
        server = None
        if args.process_per_slice == "connect":

            from entity_assets.spark_connect import LocalSparkConnect

            server = LocalSparkConnect(env.home / "spark", port=free_port())
            with Timer() as t:
                server.start(timeout=180)
            log(f"spark connect server ready in {t.s:.1f}s")
        try:
            for i in range(args.slices):
                produce(env, args.slice_size, args.slice_size, 0, graph, 100 + i)
                with Timer() as t:
                    runs = _run_slice(args.process_per_slice, server, steps)
                if runs is None or not all(r["success"] for r in runs):
                    log(f"small slice {i + 1} FAILED")
                    return 1
                times.append(t.s)
                state = _record_slice(i, t.s, runs, lake, state, by_step, rewritten)
        finally:
            if server is not None:
                server.stop()
        history_s = _history_seconds(lake)
    print(kv_line(n=args.n, entities=entities, devices=args.devices, slice_size=args.slice_size, slices=args.slices,
                  process_per_slice=args.process_per_slice or "no", lake=args.lake, rtt_ms=args.rtt_ms,
                  state_s=round(big.s, 1), median_s=round(statistics.median(times), 2),
                  state_file_rows=build_resources()["lake"].state_file_rows,
                  rewritten_rows=round(statistics.median(rewritten)),
                  history_s=round(statistics.median(history_s), 3), peak_driver_mb=round(driver_peak_mb()),
                  **{f"{k}_s": round(statistics.median(v), 2) for k, v in by_step.items()}))
    return 0


def s3_lake(env: BenchEnv, rtt_ms: float, stores: contextlib.ExitStack, request_log: str = "") -> None:
    """Starts moto's S3 server and a latency proxy to it (stopped by `stores`), and points the
    lake at a bucket through the proxy, by the standard AWS variables (the Spark workers, children
    of this process, inherit them)."""
    import boto3

    from entity_assets.local_stores import LatencyProxy, LocalS3

    s3 = LocalS3(env.home / "s3", port=free_port())
    s3.start(timeout=60)
    stores.callback(s3.stop)
    proxy = LatencyProxy(env.home / "proxy", port=free_port(), target=s3.port, rtt_ms=rtt_ms,
                         log=os.path.abspath(request_log) if request_log else "")
    proxy.start(timeout=30)
    stores.callback(proxy.stop)
    aws = {"AWS_ENDPOINT_URL": proxy.endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true", "AWS_EC2_METADATA_DISABLED": "true"}
    os.environ.update(aws, ENTITY_ASSETS_LAKE="s3://bench/lake")
    boto3.client("s3", endpoint_url=s3.endpoint, region_name=aws["AWS_REGION"], aws_access_key_id="bench",
                 aws_secret_access_key="bench").create_bucket(Bucket="bench")
    log(f"lake on s3://bench/lake: moto pid {s3.pid()}, {rtt_ms:g} ms a request through proxy pid {proxy.pid()}")


def _run_slice(mode: str | None, server, steps) -> list[dict] | None:
    """The pending slice: in this process (its session warm), or as the daemon runs it (None if it failed)."""
    from entity_assets.cli import run_pending

    if mode is None:
        return run_pending(steps=steps, log=lambda *_: None)
    env = {**os.environ, "ENTITY_ASSETS_SPARK_MASTER": server.url if server else "local[*]"}
    done = subprocess.run([sys.executable, "-m", "entity_assets.cli", "run"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        log(done.stdout[-2000:] + done.stderr[-2000:])
        return None
    return [{"success": True, "steps": {}}]  # the process's own steps are not split


def _history_seconds(lake, n: int = 5) -> list[float]:
    """Seconds of `entity-assets history` (`history.entity_history`) of n entities of the state
    slice, after the small slices: how a history's cost grows with the lake's slices."""
    from entity_assets import core
    from entity_assets.history import entity_history
    from entity_assets.storage import read_batches

    files = lake.files("entity_updates")
    keys = next(read_batches(lake.files("entities")[0], lake.storage_options, batch_size=n,
                             columns=list(core.ENTITY_KEY))).to_pylist()
    times = []
    for key in keys:
        with Timer() as t:
            found = entity_history(lake, *(key[c] for c in core.ENTITY_KEY))
        times.append(t.s)
        if not found:
            raise RuntimeError(f"no history for {key}")
    log(f"history of {len(keys)} entities over {sum(f.rows for f in files):,} entity_updates rows in "
        f"{len(files)} files: median {statistics.median(times):.3f}s")
    return times


def _record_slice(i, seconds, runs, lake, before, by_step, rewritten) -> dict:
    """Logs the slice and records its step times and rewritten rows; returns the state's files after it."""
    steps_s = step_seconds(runs)
    for step, sec in steps_s.items():
        by_step.setdefault(step, []).append(sec)
    state = {f.path: f for f in lake.files("entities")}
    new = [f for p, f in state.items() if p not in before]
    rewritten.append(sum(f.rows for f in new))
    log(f"small slice {i + 1}: {seconds:.2f}s " + ", ".join(f"{k} {v:.2f}s" for k, v in steps_s.items())
        + f"; entities rows written {rewritten[-1]:,} of {sum(f.rows for f in state.values()):,}"
          f" ({len(new)} of {len(state)} files)")
    return state


if __name__ == "__main__":
    sys.exit(main())
