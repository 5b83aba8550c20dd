"""Bench: patches through the entity core (issue: entity core) or the whole graph.

    python bench/bench_pipeline.py --n 1000000                  # entity_batches -> complete_responses
    python bench/bench_pipeline.py --n 1000000 --graph          # the whole graph, 10,000 devices, learning on
    python bench/bench_pipeline.py --n 20000                    # a quick run

In the same run, a single-process reference fold of the same input (parse, apply, serialize
each update; no storage) runs in a child process before the pipeline and again after it (this
host's speed drifts: the ratio uses both), and a 100-message slice measures the fixed cost of
one slice through the same path. Rates exclude Spark start. The last line is machine-readable
key=value pairs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from pathlib import Path

from common import (
    REPO, BenchEnv, Profiler, ResourceSampler, Timer, driver_peak_mb, jvm_pid, kv_line, log, print_profile,
    step_seconds, step_windows,
)

CORE_STEPS = ["ingest", "entity_patches", "apply_patches"]


def traffic(n: int, entities: int, devices: int, learning: bool, seed: int):
    from entity_assets.samples import BatchTraffic, GraphTraffic

    zones = tuple(f"zone-{i}" for i in range(devices)) if devices else BatchTraffic.zones
    batches = BatchTraffic(patches=n, entities=entities, ops=3, seed=seed, learning=learning, zones=zones)
    return GraphTraffic(batches, devices=devices) if devices else batches


def reference_values(n: int, entities: int, devices: int, learning: bool, seed: int) -> list[str]:
    """The entity-batches messages the reference fold reads."""
    return [v for stream, _, v in traffic(n, entities, devices, learning, seed).records() if stream == "entity-batches"]


def fold_values(values: list[str], *, loads=json.loads, dumps=json.dumps, on_update=None) -> dict:
    """The single-process baseline: parse each batch, apply each patch, serialize each update.

    `loads`/`dumps`: the stdlib's JSON for the reference; bench_floor.py validates with the
    seed's model and serializes with pydantic-core, and has `on_update(batch, patch, doc)` learn
    from each update."""
    from entity_assets.patch import apply_patch

    state: dict[tuple, dict] = {}
    patches = 0
    started, cpu = time.perf_counter(), time.process_time()
    for value in values:
        batch = loads(value)
        for patch in batch["patches"]:
            key = (batch["dbid"], patch["collection"], patch["zone"], patch["entity"])
            outcome = apply_patch(state.get(key), patch["ops"])
            if outcome.status == 1:
                state[key] = outcome.doc
                if on_update is not None:
                    on_update(batch, patch, outcome.doc)
            dumps({"clientid": batch["clientid"], "request": batch["request"], "user": batch["user"],
                   "dbid": batch["dbid"], "begun": batch["begun"], **patch, "status": outcome.status,
                   "error": outcome.error, "after": outcome.doc})
            patches += 1
    seconds = time.perf_counter() - started
    return {"patches": patches, "seconds": seconds, "per_s": patches / seconds, "cpu_s": time.process_time() - cpu}


def produce(env: BenchEnv, n: int, entities: int, devices: int, learning: bool, seed: int) -> None:
    """Produces in a child process so that generating the input does not count as driver memory."""
    # one zone per device: each change notifies the few devices watching its zone, not thousands
    cmd = [sys.executable, "-m", "entity_assets.cli", "--port", str(env.port), "produce", "sample",
           "--patches", str(n), "--entities", str(entities), "--devices", str(devices), "--seed", str(seed),
           "--zones", str(devices)]
    if learning:
        cmd.append("--learning")
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def child_reference(args, when: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--reference-only", "--n", str(args.n), "--entities",
                          str(args.entities), "--devices", str(args.devices), "--seed", str(args.seed)]
                         + (["--graph"] if args.graph else []), check=True, stdout=subprocess.PIPE, text=True).stdout
    reference = json.loads(out.strip().splitlines()[-1])
    log(f"reference fold {when}: {reference['per_s']:,.0f} patches/s ({reference['patches']:,} in "
        f"{reference['seconds']:.1f}s)")
    return reference


def _sum_cpu(parts) -> dict[str, float]:
    total: dict[str, float] = {}
    for part in parts:
        for group, v in part.items():
            total[group] = total.get(group, 0.0) + v
    return total


def traffic_parser(description: str) -> argparse.ArgumentParser:
    """The traffic options this bench and bench_floor.py share (`traffic_args` completes them)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--n", type=int, default=1_000_000, help="patches")
    parser.add_argument("--entities", type=int, default=None, help="default n / 10")
    parser.add_argument("--graph", action="store_true", help="the whole graph: subscriptions, learning, devices")
    parser.add_argument("--devices", type=int, default=None, help="default 10,000 with --graph, else 0")
    parser.add_argument("--seed", type=int, default=7)
    return parser


def traffic_args(args: argparse.Namespace) -> argparse.Namespace:
    args.entities = args.entities or max(1, args.n // 10)
    args.devices = (10_000 if args.graph else 0) if args.devices is None else args.devices
    return args


def main(argv=None) -> int:
    parser = traffic_parser(__doc__.split("\n")[0])
    publishing = parser.add_mutually_exclusive_group()
    publishing.add_argument("--no-publish", action="store_true", help="do not publish derived streams to Kafka")
    publishing.add_argument("--publish", metavar="STREAMS", default=None,
                            help="publish only these derived streams, comma-separated seed names (ENTITY_ASSETS_PUBLISH)")
    parser.add_argument("--profile", metavar="PY_SPY", default=None,
                        help="path of a py-spy binary: profile the driver and the Spark Python workers during "
                             "the big slice (slows them: do not compare its rates)")
    parser.add_argument("--profile-dir", default=str(Path(__file__).resolve().parent / "out" / "profile"))
    parser.add_argument("--cluster", metavar="BOOTSTRAP", default=None,
                        help="a Kafka cluster's bootstrap servers instead of the embedded broker: the run's topics "
                             "get a prefix of their own and are deleted at the end; the broker's CPU is not measured")
    parser.add_argument("--reference-only", action="store_true", help=argparse.SUPPRESS)
    args = traffic_args(parser.parse_args(argv))
    learning = args.graph
    if args.reference_only:
        print(json.dumps(fold_values(reference_values(args.n, args.entities, args.devices, learning, args.seed))))
        return 0

    import os

    if args.no_publish or args.publish:
        os.environ["ENTITY_ASSETS_PUBLISH"] = "false" if args.no_publish else args.publish
    with BenchEnv(cluster=args.cluster) as env:
        with Timer() as t:
            produce(env, args.n, args.entities, args.devices, learning, args.seed)
        log(f"produced {args.n:,} patches ({args.devices:,} devices, learning {learning}) in {t.s:.1f}s")
        before = child_reference(args, "before the pipeline")

        from entity_assets.cli import run_pending
        from entity_assets.definitions import build_resources

        resources = build_resources()
        kafka, spark = resources["kafka"], resources["spark"]
        published = ("none" if not kafka.publish else "all" if kafka.published_streams is None
                     else "+".join(kafka.published_streams) or "none")
        with Timer() as start:
            session = spark.session()
        log(f"Spark started in {start.s:.1f}s (excluded)")
        session.range(1).count()  # the first job pays the worker start, like every later run would not
        steps = None if args.graph else CORE_STEPS
        profiler = Profiler(args.profile, Path(args.profile_dir)) if args.profile else None
        if profiler:
            profiler.start(os.getpid(), jvm_pid(session))
        with ResourceSampler(jvm=jvm_pid(session), broker=env.broker_pid) as sampler, Timer() as run:
            summaries = run_pending(steps=steps, log=log)
        if profiler:
            profiler.stop()
        if not all(s["success"] for s in summaries):
            log("a slice run FAILED")
            return 1
        per_s = before["patches"] / run.s  # the same patches as the reference (subscriptions included)
        peak_big = driver_peak_mb()  # before the small slice, whose redelivery scan reads the window in the driver
        step_s = step_seconds(summaries)
        step_cpu = {step: _sum_cpu(sampler.cpu_between(*w) for w in ws) for step, ws in step_windows(summaries).items()}

        # fixed cost: one 100-message slice through the same path
        produce(env, 100, 100, 0, learning, args.seed + 1)  # 100 entities: ~every state bucket
        with Timer() as small:
            small_runs = run_pending(steps=steps, log=log)
        fixed = small.s if all(s["success"] for s in small_runs) else float("nan")
        fixed_steps = step_seconds(small_runs)
    after = child_reference(args, "after the pipeline")
    # the host's speed over the pipeline's time, as both reference runs together saw it
    reference = {"patches": before["patches"], "per_s": 2 * before["patches"] / (before["seconds"] + after["seconds"]),
                 "cpu_us": 1e6 * (before["cpu_s"] + after["cpu_s"]) / (2 * before["patches"])}

    if args.profile:
        print_profile(Path(args.profile_dir))
    ratio = per_s / reference["per_s"]
    target = 0.5 if args.graph else 1.0
    print()
    print(f"patches            {args.n:,} over {args.entities:,} entities, 3 ops each"
          + (f"; {args.devices:,} devices subscribed, learning on" if args.graph else "")
          + f"; published streams: {published}")
    print(f"pipeline           {per_s:,.0f} patches/s ({run.s:.1f}s for {len(summaries)} slice run(s), Spark start "
          f"{start.s:.1f}s excluded)")
    print(f"reference fold     {reference['per_s']:,.0f} patches/s (one process, no storage; {before['per_s']:,.0f} "
          f"before the pipeline, {after['per_s']:,.0f} after)")
    print(f"ratio              {ratio:.2f} (target >= {target})")
    print(f"  {'step':<27} {'wall':>6}  {'patches/s':>12}   CPU-s: {'workers':>7} {'jvm':>5} {'broker':>6} {'driver':>6}")
    for step, sec in step_s.items():
        c = step_cpu.get(step, {})
        print(f"  step {step:<22} {sec:6.1f}s  {reference['patches'] / sec if sec else 0:>12,.0f}          "
              + " ".join(f"{c.get(g, 0):{w}.1f}" for g, w in (("workers", 7), ("jvm", 5), ("broker", 6), ("driver", 6))))
    print(f"100-message slice  {fixed:.1f}s (fixed cost of one slice run): "
          + ", ".join(f"{step} {sec:.1f}s" for step, sec in fixed_steps.items()))
    cpu = sampler.cpu()
    cpu_us = 1e6 * sum(v for k, v in cpu.items() if k != "foreign") / reference["patches"]
    print("CPU seconds        " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
    print(f"CPU per patch      pipeline {cpu_us:.0f} us (its processes together), reference fold "
          f"{reference['cpu_us']:.0f} us")
    print(f"peak driver RSS    {driver_peak_mb():.0f} MB (this process; Spark's JVM and workers are children); "
          f"{peak_big:.0f} MB before the 100-message slice")
    print(kv_line(n=args.n, per_s=round(per_s), reference_per_s=round(reference["per_s"]), ratio=round(ratio, 3),
                  reference_before_per_s=round(before["per_s"]), reference_after_per_s=round(after["per_s"]),
                  cpu_us_per_patch=round(cpu_us), reference_cpu_us_per_patch=round(reference["cpu_us"]),
                  graph=int(args.graph), devices=args.devices, published=published,
                  broker="cluster" if args.cluster else "embedded", spark_start_s=round(start.s, 1),
                  fixed_100_s=round(fixed, 1), peak_driver_mb=round(driver_peak_mb()), peak_driver_big_mb=round(peak_big),
                  **{f"{k}_s": round(v, 1) for k, v in step_s.items()},
                  **{f"cpu_{k}_s": round(v, 1) for k, v in cpu.items()},
                  **{f"{step}_cpu_{g}_s": round(v, 1) for step, c in step_cpu.items() for g, v in c.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
