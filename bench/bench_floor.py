"""Bench: the best ratio any implementation of bench_pipeline.py's path can reach on this machine.

    python bench/bench_floor.py --n 1000000              # the entity core's streams
    python bench/bench_floor.py --n 1000000 --graph      # the whole graph's (10,000 devices)
    python bench/bench_floor.py --n 20000                # a quick run

bench_pipeline.py compares the pipeline with a reference fold that reads nothing from Kafka,
stores nothing and publishes nothing. This bench measures alone, each as fast as this project
knows how, four parts that no implementation of the issues can leave out, with the broker's
CPU for each (its saves included, until it is idle again):

  read      every input message, by two readers in parallel (`kafka_io.read_range`)
  fold      the reference fold's loop as a compliant pipeline needs it at least: each batch
            validated against the seed's model (pydantic-core, faster than the stdlib's JSON),
            each patch applied, its result serialized; with --graph, each learned document
            observed for learned_schemas
  publish   the messages the issue's streams carry, made beforehand with the pipeline's
            encoders, sent by two `kafka_io.BatchProducer`s in parallel (the pipeline's
            producer settings). The entity core: entity-patches, entity-updates,
            partial-responses, complete-responses. With --graph also schema-learning,
            zone-changes and changes-by-device (not device-notifications, nor what the
            subscriptions' own patches add: an undercount keeps this a floor)
  store     the least the lake holds of them: each input message, and each published
            message's key and text, as parquet files (pyarrow, the lake's snappy), written
            by the same two processes from Arrow tables made beforehand

Validation of the other input streams, dead letters, typed columns, entity state, Delta
commits, the zone, device and notification logic, Spark and Dagster are left out. The four parts' CPU-seconds, spread over the machine's cores without loss, are the
least time any implementation needs here; `ceiling` is the ratio against the reference fold
that this time allows. Making the messages and starting the processes are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from common import BenchEnv, Timer, cpu_s, kv_line, log
from bench_pipeline import (
    child_reference, fold_values, produce, reference_values, traffic, traffic_args, traffic_parser,
)

READERS = PRODUCERS = 2  # Spark's task slots on this machine (`local[*]`, 2 cores)


def _settle(pid: int, since: float, quiet_s: float = 0.05, limit_s: float = 180.0) -> float:
    """CPU-seconds of `pid` since it read `since`, once a whole second passes with under `quiet_s`
    of it: the embedded broker keeps saving for a while after it was written to."""
    last, deadline = cpu_s(pid), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = cpu_s(pid)
        if now - last < quiet_s:
            return now - since
        last = now
    return cpu_s(pid) - since


def _run(args, role: str, payloads: list[str], broker: int, phases: int = 1) -> list[dict]:
    """A role's children (one per payload), through each of its phases: each phase starts in all
    of them at once once all are ready; its CPU-seconds, wall time and the broker's CPU-seconds."""
    procs = [subprocess.Popen([sys.executable, __file__, "--role", role, "--payload", payload, "--n", str(args.n),
                               "--entities", str(args.entities), "--devices", str(args.devices), "--seed",
                               str(args.seed), "--bootstrap", args.bootstrap] + (["--graph"] if args.graph else [])
                              + [f"--producer={kv}" for kv in args.producer],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for payload in payloads]
    results = []
    for _ in range(phases):
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {role} child failed before it was ready (exit status {p.wait()})")
        broker_before = cpu_s(broker)
        with Timer() as t:
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            reports = [json.loads(p.stdout.readline()) for p in procs]
        results.append({"seconds": t.s, "cpu_s": sum(r["cpu_s"] for r in reports),
                        "count": sum(r["count"] for r in reports), "broker_cpu_s": _settle(broker, broker_before),
                        "reports": reports})
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"a {role} child failed")
    return results


def _wait_for_go() -> None:
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(1)


def read_role(args) -> Iterator[dict]:
    """Reads its offset ranges (`--payload`: a JSON list of [topic, partition, start, end])."""
    from entity_assets.kafka_io import read_range
    from entity_assets.slices import OffsetRange

    ranges = [OffsetRange(*r) for r in json.loads(args.payload)]
    config = {"bootstrap.servers": args.bootstrap}
    _wait_for_go()
    cpu, count = time.process_time(), 0
    for r in ranges:
        for _ in read_range(config, r):
            count += 1
    yield {"cpu_s": time.process_time() - cpu, "count": count}


def messages(args, share: int) -> tuple[list[tuple[str, str, str, int]], list[tuple]]:
    """(topic, key, value, partition; -1: by key) of the streams this bench publishes, for every
    batch whose index modulo PRODUCERS is `share`, made with the pipeline's encoders; and the
    (key, value) of this share of every input record, for the store part."""
    from entity_assets import core
    from entity_assets.publish import STREAMS, partition_for, request_key_of

    partitions = args.topic_partitions
    sample = traffic(args.n, args.entities, args.devices, args.graph, args.seed)
    watching: dict[str, list[tuple[str, list[str]]]] = {}  # by zone: its subscribed devices and their actions
    for device, zone, actions in sample.subscriptions() if args.devices else ():
        watching.setdefault(zone, []).append((device, actions))
    out: list[tuple[str, str, str, int]] = []
    inputs: list[tuple] = []
    states: dict[tuple, core.DocState] = {}
    index = -1  # of the entity batch
    for record, (stream, key, value) in enumerate(sample.records()):
        if record % PRODUCERS == share:
            inputs.append((key, value))
        if stream != "entity-batches":
            continue
        index += 1
        batch = core.loads(value)
        parts, results = len(batch["patches"]), []
        for part, patch in enumerate(batch["patches"], start=1):
            row = {**{k: batch.get(k) for k in ("clientid", "request", "user", "dbid", "begun")},
                   "learning": batch.get("learning", False), "includeBefore": batch.get("includeBefore", False),
                   "includeAfter": batch.get("includeAfter", False), "collection": patch["collection"],
                   "zone": patch["zone"], "entity": patch["entity"], "parts": parts, "part": part,
                   "ops": core.dumps(patch["ops"]), "kafka_timestamp": batch["begun"], "kafka_topic": "entity-batches",
                   "kafka_partition": 0, "kafka_offset": index}
            state = states.setdefault(tuple(row[k] for k in core.ENTITY_KEY), core.DocState())
            result = core.apply_one(state, row)
            results.append(result)
            if index % PRODUCERS != share:
                continue
            request, by_client = request_key_of(row), partition_for(row["clientid"], partitions)
            out.append((STREAMS["entity_patches"].name, row["entity"], core.patch_json(row), -1))
            out.append((STREAMS["partial_responses"].name, request, core.result_json(result), by_client))
            if result["status"] != 1:
                continue
            out.append((STREAMS["entity_updates"].name, row["entity"], core.result_json(result), -1))
            if not args.graph:
                continue
            if row["learning"]:
                learned = {**result, "after": core.learned_after(result["after"], state.doc or {}), "kind": "entity"}
                out.append((STREAMS["schema_learning"].name, row["entity"], core.result_json(learned),
                            partition_for(row["collection"], partitions)))
            out.append((STREAMS["zone_changes"].name, row["entity"], core.result_json(result),
                        partition_for(row["zone"], partitions)))
            for device, actions in watching.get(row["zone"], ()):
                if result["action"] in actions:
                    change = {**result, "notification": f"{row['entity']}:{state.version}:{device}"}
                    out.append((STREAMS["changes_by_device"].name, device, STREAMS["changes_by_device"].encode(change),
                                -1))
        if index % PRODUCERS == share:
            complete = core.complete_row(results, "0000000001")
            out.append((STREAMS["complete_responses"].name, request_key_of(complete), core.complete_json(complete),
                        partition_for(complete["clientid"], partitions)))
    return out, inputs


def publish_role(args) -> Iterator[dict]:
    """Publishes its share of the messages (`--payload`), then stores them and its share of the input."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from entity_assets.kafka_io import BatchProducer
    from entity_assets.storage import ROW_GROUP_ROWS

    share = int(args.payload)
    todo, inputs = messages(args, share)
    producer = BatchProducer({"bootstrap.servers": args.bootstrap, **dict(kv.split("=", 1) for kv in args.producer)})
    _wait_for_go()
    cpu = time.process_time()
    for topic, key, value, partition in todo:
        producer.send(topic, key, value, None if partition < 0 else partition)
    producer.close()
    yield {"cpu_s": time.process_time() - cpu, "count": len(todo)}

    columns: dict[str, tuple[list, list]] = {}
    for topic, key, value, _ in todo:
        keys, values = columns.setdefault(topic, ([], []))
        keys.append(key)
        values.append(value)
    columns["input"] = tuple(map(list, zip(*inputs)))
    del todo, inputs
    tables = {topic: pa.table({"key": pa.array(keys, pa.string()), "value": pa.array(values, pa.string())})
              for topic, (keys, values) in columns.items()}
    del columns
    with tempfile.TemporaryDirectory(prefix="entity-assets-floor-") as folder:
        _wait_for_go()
        cpu = time.process_time()
        for topic, table in tables.items():
            pq.write_table(table, f"{folder}/{topic}.parquet", compression="snappy", row_group_size=ROW_GROUP_ROWS)
        yield {"cpu_s": time.process_time() - cpu, "count": sum(t.num_rows for t in tables.values())}


def fold_role(args) -> Iterator[dict]:
    """The least fold a compliant pipeline runs, between two runs of the reference fold over the
    same values (this host's speed drifts within minutes): each batch validated against the
    seed's model (the bad-input policy) and serialized with pydantic-core; with --graph, each
    learned document observed for learned_schemas."""
    from entity_assets import core
    from entity_assets.learning import Summary
    from entity_assets.messages import EntityBatch

    values = reference_values(args.n, args.entities, args.devices, args.graph, args.seed)
    summaries: dict[tuple, Summary] = {}

    def learn(batch, patch, doc) -> None:
        if batch["learning"] and doc is not None:
            summaries.setdefault((batch["dbid"], patch["collection"]), Summary()).observe(doc)

    _wait_for_go()
    before = fold_values(values)
    least = fold_values(values, loads=lambda v: vars(EntityBatch.model_validate_json(v)), dumps=core.dumps,
                        on_update=learn if args.graph else None)
    after = fold_values(values)
    yield {"cpu_s": least["cpu_s"], "count": least["patches"], "reference_s": [before["seconds"], after["seconds"]],
           "reference_cpu_s": [before["cpu_s"], after["cpu_s"]]}


ROLES = {"read": read_role, "fold": fold_role, "publish": publish_role}


def main(argv=None) -> int:
    parser = traffic_parser(__doc__.split("\n")[0])
    parser.add_argument("--producer", action="append", default=[], metavar="KEY=VALUE",
                        help="a librdkafka setting over the pipeline's (kafka_io.PRODUCER_DEFAULTS), to look for a "
                             "cheaper publish; repeatable")
    parser.add_argument("--role", choices=sorted(ROLES), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--payload", default="", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    args = traffic_args(parser.parse_args(argv))
    from resources.kafka import KafkaResource

    args.topic_partitions = KafkaResource.model_fields["new_topic_partitions"].default
    if args.role:
        for report in ROLES[args.role](args):
            print(json.dumps(report), flush=True)
        return 0

    from entity_assets.ingest import INPUT_STREAMS
    from entity_assets.kafka_io import ensure_topics, watermarks
    from entity_assets.publish import STREAMS

    with BenchEnv() as env:
        args.bootstrap = env.bootstrap
        with Timer() as t:
            produce(env, args.n, args.entities, args.devices, args.graph, args.seed)
        log(f"produced {args.n:,} patches ({args.devices:,} devices, learning {args.graph}) in {t.s:.1f}s")
        reference = child_reference(args, "before the floor")
        config = {"bootstrap.servers": env.bootstrap}
        ensure_topics(config, [s.name for s in STREAMS.values()], args.topic_partitions)
        _settle(env.broker_pid, cpu_s(env.broker_pid))

        offsets = watermarks(config, list(INPUT_STREAMS))
        held = [[topic, p, low, high] for (topic, p), (low, high) in sorted(offsets.items()) if high > low]
        read, = _run(args, "read", [json.dumps(held[i::READERS]) for i in range(READERS)], env.broker_pid)
        log(f"read {read['count']:,} messages in {read['seconds']:.1f}s: {read['cpu_s']:.1f} CPU-s, "
            f"broker {read['broker_cpu_s']:.1f}")
        fold, = _run(args, "fold", [""], env.broker_pid)
        log(f"fold {fold['count']:,} patches: {fold['cpu_s']:.1f} CPU-s")
        publish, store = _run(args, "publish", [str(i) for i in range(PRODUCERS)], env.broker_pid, phases=2)
        log(f"published {publish['count']:,} messages in {publish['seconds']:.1f}s: {publish['cpu_s']:.1f} CPU-s, "
            f"broker {publish['broker_cpu_s']:.1f}")
        log(f"stored {store['count']:,} rows in {store['seconds']:.1f}s: {store['cpu_s']:.1f} CPU-s")
    after = child_reference(args, "after the floor")
    patches = reference["patches"]
    # the reference fold's four runs: before the floor, beside its fold (twice) and after it
    references = [reference["seconds"], *fold["reports"][0]["reference_s"], after["seconds"]]
    reference_s = sum(references) / len(references)
    reference_per_s = patches / reference_s
    cores = os.cpu_count() or 1
    parts = {"read": read["cpu_s"] + read["broker_cpu_s"], "fold": fold["cpu_s"],
             "publish": publish["cpu_s"] + publish["broker_cpu_s"], "store": store["cpu_s"]}
    floor_cpu = sum(parts.values())
    ceiling_per_s = patches / (floor_cpu / cores)
    ceiling = ceiling_per_s / reference_per_s
    target = 0.5 if args.graph else 1.0
    print()
    print(f"patches            {args.n:,} over {args.entities:,} entities, 3 ops each"
          + (f"; {args.devices:,} devices subscribed, learning on" if args.graph else "")
          + (f"; producer {' '.join(args.producer)}" if args.producer else ""))
    print(f"reference fold     {reference_per_s:,.0f} patches/s (mean of {len(references)} runs: "
          + ", ".join(f"{r:.1f}" for r in references) + "s; stdlib JSON)")
    print(f"  read             {read['count']:>10,} messages  {parts['read']:6.1f} CPU-s "
          f"(readers {read['cpu_s']:.1f}, broker {read['broker_cpu_s']:.1f}; {read['seconds']:.1f}s)")
    print(f"  fold             {fold['count']:>10,} patches   {parts['fold']:6.1f} CPU-s (validated; "
          f"the reference's loop beside it " + " and ".join(f"{c:.1f}" for c in fold["reports"][0]["reference_cpu_s"])
          + ")")
    print(f"  publish          {publish['count']:>10,} messages  {parts['publish']:6.1f} CPU-s "
          f"(producers {publish['cpu_s']:.1f}, broker {publish['broker_cpu_s']:.1f}; {publish['seconds']:.1f}s)")
    print(f"  store            {store['count']:>10,} rows      {parts['store']:6.1f} CPU-s ({store['seconds']:.1f}s)")
    print(f"floor              {floor_cpu:.1f} CPU-s on {cores} cores: at best {floor_cpu / cores:.1f}s, "
          f"{ceiling_per_s:,.0f} patches/s")
    print(f"ceiling            {ceiling:.2f} of the reference fold (target >= {target}); the reference fold's "
          f"{reference_s:.1f}s allow {cores * reference_s / target:.1f} CPU-s at the target")
    print(kv_line(n=args.n, graph=int(args.graph), devices=args.devices, reference_per_s=round(reference_per_s),
                  ceiling_per_s=round(ceiling_per_s), ceiling=round(ceiling, 3), target=target,
                  floor_cpu_s=round(floor_cpu, 1), read_messages=read["count"], read_cpu_s=round(read["cpu_s"], 1),
                  read_broker_cpu_s=round(read["broker_cpu_s"], 1), fold_cpu_s=round(fold["cpu_s"], 1),
                  reference_cpu_s=round(sum(fold["reports"][0]["reference_cpu_s"]) / 2, 1), published=publish["count"],
                  publish_cpu_s=round(publish["cpu_s"], 1), publish_broker_cpu_s=round(publish["broker_cpu_s"], 1),
                  stored_rows=store["count"], store_cpu_s=round(store["cpu_s"], 1),
                  cores=cores, producer=",".join(args.producer) or "pipeline"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
