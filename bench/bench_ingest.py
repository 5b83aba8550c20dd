"""Bench: Kafka entity-batches -> sensor -> `ingest` (entity_batches) -> Delta, through Dagster.

    .venv/bin/python bench/bench_ingest.py               # N = 1,000,000
    .venv/bin/python bench/bench_ingest.py --n 100000
    .venv/bin/python bench/bench_ingest.py --n 1000000 --per-task 125000,250000,500000 --repeat 2

Steps, in a temporary ENTITY_ASSETS_HOME with its own broker on its own port:
  1. start the local broker (LocalBroker) and create the input topics (4 partitions, as
     `entity-assets broker start` does);
  2. produce BatchTraffic(patches=N, entities=N//10, ops=3) to entity-batches, in a child
     process (not in the rate, not in the driver's memory);
  3. per trial: start a SparkSession through the definitions' SparkResource and time it
     (spark_start_s, excluded from the rate);
  4. timed: one evaluation of `kafka_offsets_sensor` (closes the slices, writes their
     manifests), then each requested slice run through `slice_job` with `execute_in_process`
     on the Dagster instance, as `entity-assets run` does: Spark tasks read Kafka, validate,
     write parquet; the driver commits each table's files to Delta;
  5. checks the rows (entity_batches == N, dead_letters == 0), reads CPU and memory, stops
     Spark; at the end stops the broker by its pid and removes the home.

Each trial uses a fresh lake (so the sensor closes the same slices again) and a new
SparkContext: Python workers start cold as in a real run; trials after the first reuse the
driver's JVM (pyspark keeps its gateway), so their Spark start is shorter.

The last line is machine-readable key=value pairs (README.md lists them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    QLIK_SCHEMA_TOPIC, BenchEnv, Profiler, ResourceSampler, Timer, driver_peak_mb, jvm_pid, kv_line, log, print_profile,
    vm_hwm_mb,
)

DEFAULT_PER_TASK = 200_000
"""max_messages_per_task of the default run: the fastest of the values swept at N = 1M (README.md), and
SlicingResource's own default."""

_PHASES: dict[str, float] = {}


def _instrument_ingest() -> None:
    """Times the ingest asset's two big phases (Spark tasks, Delta commit) by wrapping the
    helpers it calls, into `_PHASES`; behaviour is unchanged."""
    import entity_assets.assets.ingest as asset_module

    for name, label in (("run_tasks", "spark_tasks_s"), ("commit_slice", "delta_commit_s")):
        original = getattr(asset_module, name, None)
        if original is None or getattr(original, "_bench_timed", False):
            continue

        def timed(*args, _original=original, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _PHASES[_label] = _PHASES.get(_label, 0.0) + time.perf_counter() - start

        timed._bench_timed = True
        setattr(asset_module, name, timed)


def spark_stages(spark) -> list[dict]:
    """Per-stage task metrics from the Spark UI's REST API (empty if the UI is disabled)."""
    sc = spark.sparkContext
    if not sc.uiWebUrl:
        return []
    try:
        base = f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}"
        with urllib.request.urlopen(f"{base}/stages", timeout=30) as r:
            stages = json.load(r)
        out = []
        for st in sorted(stages, key=lambda s: s["stageId"]):
            url = f"{base}/stages/{st['stageId']}/{st['attemptId']}/taskSummary?quantiles=0,0.5,1"
            with urllib.request.urlopen(url, timeout=30) as r:
                summary = json.load(r)
            out.append({"stage": st["stageId"], "tasks": st["numTasks"], "run_s": st["executorRunTime"] / 1000,
                        "task_s": [round(x / 1000, 1) for x in summary["duration"]]})
        return out
    except Exception as exc:  # the breakdown is a nicety: never fail the bench for it
        return [{"error": f"{type(exc).__name__}: {exc}"}]


def run_trial(n: int, batches: int, *, lake_root: Path, per_task: int, max_messages: int | None,
              spark_master: str | None, spark_conf: dict[str, str], quiet: bool, broker_pid: int | None,
              profiler: Profiler | None = None) -> dict:
    """One cold ingest of the N messages already in the broker, which make `batches` entity_batches
    rows; returns the figures."""
    from dagster import DagsterInstance, Definitions, build_sensor_context

    from entity_assets.assets.ingest import ingest
    from entity_assets.definitions import build_resources
    from entity_assets.jobs import slice_job
    from entity_assets.sensors import kafka_offsets_sensor
    from resources import with_settings

    resources = build_resources()
    base = resources["slicing"]
    resources["slicing"] = with_settings(base, min_interval_seconds=0,  # close a slice now: no waiting
                                         max_messages=max_messages or base.max_messages, max_messages_per_task=per_task)
    resources["lake"] = with_settings(resources["lake"], root=str(lake_root))
    if spark_master or spark_conf:
        spark = resources["spark"]
        resources["spark"] = with_settings(spark, master=spark_master or spark.master, conf={**spark.conf, **spark_conf})
    # Only the ingest asset: the bench measures entity_batches, not the rest of the graph.
    defs = Definitions(assets=[ingest], jobs=[slice_job], sensors=[kafka_offsets_sensor], resources=resources)
    job = defs.resolve_job_def("slice_job")
    instance = DagsterInstance.get()
    run_config = {"loggers": {"console": {"config": {"log_level": "WARNING" if quiet else "INFO"}}}}

    # The runs' SparkResource.session() -> builder.getOrCreate() returns this session.
    with Timer() as t_spark:
        spark = resources["spark"].session()
    jvm = jvm_pid(spark)
    log(f"SparkSession ({spark.sparkContext.master}, parallelism {spark.sparkContext.defaultParallelism}) "
        f"started in {t_spark.s:.1f}s; JVM pid {jvm}")

    _instrument_ingest()
    _PHASES.clear()
    if profiler:
        profiler.start(os.getpid(), jvm)
    rows: dict[str, int] = {}
    runs = []
    try:
        with ResourceSampler(jvm=jvm, broker=broker_pid) as sampler, Timer() as t_total:
            with Timer() as t_sensor:
                with build_sensor_context(instance=instance, cursor=None, resources=resources) as context:
                    result = kafka_offsets_sensor(context)
                # What the daemon does with the tick's result: add the partitions, launch the runs.
                for request in result.dynamic_partitions_requests or []:
                    instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
            requests = result.run_requests or []
            log(f"sensor: {len(requests)} slice(s) in {t_sensor.s:.2f}s"
                + (f" ({result.skip_reason.skip_message})" if result.skip_reason else ""))
            for request in requests:
                with Timer() as t_run:
                    outcome = job.execute_in_process(partition_key=request.partition_key, instance=instance,
                                                     run_config=run_config, raise_on_error=False,
                                                     tags={"dagster/run_key": request.run_key})
                if not outcome.success:
                    raise SystemExit(f"slice {request.partition_key} failed: run {outcome.run_id} "
                                     f"(rerun with --verbose for its logs)")
                for event in outcome.get_asset_materialization_events():
                    mat = event.event_specific_data.materialization
                    key = mat.asset_key.to_user_string()
                    rows[key] = rows.get(key, 0) + mat.metadata["rows"].value
                runs.append(t_run.s)
                log(f"slice {request.partition_key}: run {outcome.run_id[:8]} in {t_run.s:.1f}s")
    finally:
        if profiler:
            profiler.stop()

    figures = {
        "per_task": per_task,
        "spark_start_s": t_spark.s,
        "sensor_s": t_sensor.s,
        "runs_s": sum(runs),
        "total_s": t_total.s,
        "per_s": n / t_total.s,
        "slices": len(runs),
        "rows": rows,
        "ok": rows.get("entity_batches") == batches and rows.get("dead_letters", 0) == 0,
        "peak_driver_mb": driver_peak_mb(),
        "peak_jvm_mb": (vm_hwm_mb(jvm) if jvm else None) or 0.0,
        "peak_workers_mb": sampler.workers_peak_mb,
        "workers": sampler.workers_max,
        "peak_worker_mb": max(sampler.worker_hwm_mb.values(), default=0.0),
        "cpu": sampler.cpu(),
        "phases": dict(_PHASES),
        "stages": spark_stages(spark),
    }
    spark.stop()
    return figures


def report(n: int, f: dict, target: float) -> None:
    rows, cpu, cores = f["rows"], f["cpu"], os.cpu_count() or 1
    ours = cpu["driver"] + cpu["jvm"] + cpu["workers"] + cpu["broker"]
    capacity = cores * f["total_s"]
    f["foreign_pct"] = 100 * cpu["foreign"] / capacity if capacity else 0.0
    f["cpu_us_per_msg"] = 1e6 * ours / n
    # What the rate would have been with the cores to ourselves, assuming the other processes'
    # CPU time came straight out of ours: a rough estimate, only meaningful when foreign_pct is high.
    f["per_s_adj"] = n / max(1e-9, f["total_s"] - cpu["foreign"] / cores)
    f["tasks"] = sum(st.get("tasks", 0) for st in f["stages"])
    rest = f["runs_s"] - sum(f["phases"].values())
    print()
    print(f"messages          {n:,} in {f['slices']} slice(s), max_messages_per_task {f['per_task']:,}")
    print("rows              " + ", ".join(f"{t}={r:,}" for t, r in sorted(rows.items()))
          + ("" if f["ok"] else "   <-- MISMATCH"))
    print(f"spark start       {f['spark_start_s']:.1f}s (excluded from the rate)")
    print(f"sensor            {f['sensor_s']:.2f}s")
    print(f"slice runs        {f['runs_s']:.1f}s: Spark tasks {f['phases'].get('spark_tasks_s', 0):.1f}s, Delta commits "
          f"{f['phases'].get('delta_commit_s', 0):.2f}s, rest (Dagster, manifest, metadata) {rest:.1f}s")
    for st in f["stages"]:
        if "error" in st:
            print(f"  spark stages    unavailable: {st['error']}")
        else:
            print(f"  stage {st['stage']:<9} {st['tasks']} tasks, duration min/median/max {st['task_s']} s, "
                  f"sum {st['run_s']:.1f}s")
    print(f"sensor + runs     {f['total_s']:.1f}s  ->  {f['per_s']:,.0f} messages/s "
          f"({'meets' if f['per_s'] >= target else 'MISSES'} the {target:,.0f}/s target)")
    print(f"CPU               workers {cpu['workers']:.1f}s, JVM {cpu['jvm']:.1f}s, driver {cpu['driver']:.1f}s, "
          f"broker {cpu['broker']:.1f}s = {ours:.1f}s = {f['cpu_us_per_msg']:.0f} us/message "
          f"({cores} cores x {f['total_s']:.1f}s = {capacity:.1f}s)")
    print(f"                  other processes on this machine used {cpu['foreign']:.1f}s ({f['foreign_pct']:.0f}% of "
          f"the cores)" + (f": the rate is depressed by them; without them roughly {f['per_s_adj']:,.0f}/s "
                           f"(per_s_adj, an estimate)" if f["foreign_pct"] > 10 else ""))
    print(f"peak RSS          driver {f['peak_driver_mb']:.0f} MB (this process, getrusage ru_maxrss); "
          f"JVM {f['peak_jvm_mb']:.0f} MB (child process, /proc VmHWM)")
    print(f"                  Python workers: largest {f['peak_worker_mb']:.0f} MB (VmHWM), sum {f['peak_workers_mb']:.0f} MB "
          f"over {f['workers']} processes (sampled RSS, shared pages counted in each)")


def kv(n: int, f: dict, produced: dict, **extra) -> str:
    return kv_line(
        n=n, per_s=round(f["per_s"]), total_s=f["total_s"], spark_start_s=f["spark_start_s"], sensor_s=f["sensor_s"],
        tasks_s=f["phases"].get("spark_tasks_s", 0.0), commit_s=f["phases"].get("delta_commit_s", 0.0),
        slices=f["slices"], tasks=f["tasks"], per_task=f["per_task"], rows=f["rows"].get("entity_batches", 0),
        dead=f["rows"].get("dead_letters", 0), ok=int(f["ok"]), peak_driver_mb=round(f["peak_driver_mb"]),
        peak_jvm_mb=round(f["peak_jvm_mb"]), peak_worker_mb=round(f["peak_worker_mb"]),
        peak_workers_mb=round(f["peak_workers_mb"]), cpu_us_per_msg=round(f["cpu_us_per_msg"]),
        foreign_cpu_pct=round(f["foreign_pct"]), per_s_adj=round(f["per_s_adj"]), produce_per_s=produced["per_s"], **extra,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="messages to produce and ingest")
    parser.add_argument("--per-task", default=str(DEFAULT_PER_TASK),
                        help=f"SlicingResource.max_messages_per_task; a comma list runs one trial each "
                             f"(default {DEFAULT_PER_TASK})")
    parser.add_argument("--repeat", type=int, default=1,
                        help="trials per --per-task value, in rounds of alternating order")
    parser.add_argument("--max-messages", type=int, default=None,
                        help="SlicingResource.max_messages (default: the definitions' value, 5M: one slice per 1M)")
    parser.add_argument("--port", type=int, default=0, help="broker port (default: a free one)")
    parser.add_argument("--spark-master", default=None, help="default: the definitions' (local[*])")
    parser.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Spark conf over the definitions' (repeatable)")
    parser.add_argument("--target", type=float, default=50_000, help="messages/s the report compares with")
    parser.add_argument("--profile", metavar="PY_SPY", default=None,
                        help="path of a py-spy binary: profile the driver and the Spark Python workers during "
                             "the timed section (slows them: do not compare its rates)")
    parser.add_argument("--profile-dir", default=str(Path(__file__).resolve().parent / "out" / "profile"))
    parser.add_argument("--cdc", choices=["db2", "goldengate", "debezium", "qlik"], default=None,
                        help="ingest about N records of the sample CDC traffic of this format (its ingestion topic) "
                             "instead of entity batches")
    parser.add_argument("--schema-topic", choices=["named", "unnamed"], default=None,
                        help="with --cdc qlik: the metadata messages on a schema topic of their own, named as the "
                             "source's schema_projection (read first) or not (its data messages wait for it)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary home (lake, broker data)")
    parser.add_argument("--verbose", action="store_true", help="Dagster INFO logs of the runs")
    args = parser.parse_args(argv)
    if args.schema_topic and args.cdc != "qlik":
        parser.error("--schema-topic needs --cdc qlik")
    per_tasks = [int(x) for x in args.per_task.split(",")]
    # Rounds alternate direction (A B C, C B A, ...) so that warm-up and drift weigh on every value alike.
    plan = [p for r in range(args.repeat) for p in (per_tasks if r % 2 == 0 else per_tasks[::-1])]

    results: list[dict] = []
    with BenchEnv(port=args.port, keep=args.keep) as env:
        produced = env.produce_batches(args.n, cdc=args.cdc, schema_topic=args.schema_topic is not None)
        if args.schema_topic == "named":
            os.environ["ENTITY_ASSETS_INGESTION"] = json.dumps(
                {"*": {"schema_projection": QLIK_SCHEMA_TOPIC.split(".")[1]}})
        n = produced["messages"]
        log(f"produced {produced['messages']:,} messages ({produced['bytes'] / 1e6:.0f} MB) in "
            f"{produced['seconds']:.1f}s ({produced['per_s']:,}/s) in a child process "
            f"(peak RSS {produced['peak_rss_mb']} MB)")
        for i, per_task in enumerate(plan, 1):
            if len(plan) > 1:
                log(f"trial {i}/{len(plan)}: max_messages_per_task {per_task:,}")
            profiler = Profiler(args.profile, Path(args.profile_dir)) if args.profile and i == 1 else None
            f = run_trial(n, produced["batches"], lake_root=env.home / f"lake-{i}", per_task=per_task,
                          max_messages=args.max_messages, spark_master=args.spark_master,
                          spark_conf=dict(kv.split("=", 1) for kv in args.spark_conf), quiet=not args.verbose,
                          broker_pid=env.broker_pid, profiler=profiler)
            report(n, f, args.target)
            results.append(f)
            if len(plan) > 1:
                print("trial " + kv(n, f, produced))

    if args.profile:
        print_profile(Path(args.profile_dir))

    best = max(results, key=lambda f: f["per_s"])
    if len(plan) > 1:
        print("\nper_task      messages/s per trial            median")
        for p in per_tasks:
            rates = [f["per_s"] for f in results if f["per_task"] == p]
            print(f"{p:>10,}    {', '.join(f'{r:,.0f}' for r in rates):<30}  {statistics.median(rates):,.0f}")
        print(f"best: max_messages_per_task {best['per_task']:,}; the last line is that trial")
    ok = all(f["ok"] for f in results)
    print(kv(n, best, produced, trials=len(results), all_ok=int(ok), cdc=args.cdc or "none",
             schema_topic=args.schema_topic or "none"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
