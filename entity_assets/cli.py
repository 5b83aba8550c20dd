"""`entity-assets`: the command line for people and scripts.

    entity-assets broker start|stop|status     the embedded local Kafka-protocol broker
    entity-assets topics [--dry-run]           the input and output topics a cluster lacks, created
    entity-assets spark start|stop|status      a local Spark Connect server for the daemon's runs
    entity-assets produce sample|seed|file|cdc|acks   put traffic on the input topics
    entity-assets run                          one sensor evaluation, then every pending slice in order
    entity-assets run --slices 1..40           those slices again, in order (a rebuild; --assets to pick tables)
    entity-assets maintenance                  vacuum and log expiry, as the daemon's daily schedule
    entity-assets summary                      rows per table, dead letters per code
    entity-assets trace entity-batches:0:17    one input record's rows in every table, down to device inboxes
    entity-assets changes entities --since 12  a state's rows that the slices after 12 changed, as JSON lines
    entity-assets history DBID COLLECTION ZONE ENTITY [--slice N | --at MS]   an entity's versions, or one of them
    entity-assets demo                         all of the above on the embedded default
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import asdict
from itertools import groupby
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException
from deltalake.exceptions import DeltaError
from pydantic import ValidationError

from entity_assets.broker import DEFAULT_PORT, LocalBroker
from entity_assets.spark_connect import DEFAULT_PORT as SPARK_CONNECT_PORT
from entity_assets.ingest import INPUT_STREAMS
from entity_assets.kafka_io import DeliveryFailed, KafkaUnreachable
from entity_assets.local_service import NotInstalled, NotReady, PortInUse, write_file
from resources import SettingError, with_settings
from resources.lake import default_home

REPO = Path(__file__).resolve().parents[1]


class NoLake(Exception):
    """A lake that holds no slice: nothing run yet, or a root that names another folder."""


def _lake():
    """The deployment's lake, which must hold slices: a mistyped root would read as an empty lake."""
    from entity_assets.definitions import build_resources
    from entity_assets.manifests import TABLE as MANIFESTS

    engine = build_resources()["lake"].open()
    if not engine.exists(MANIFESTS):
        raise NoLake(f"no lake at {engine.root}: it holds no slice (nothing run yet, or ENTITY_ASSETS_LAKE or "
                     "ENTITY_ASSETS_HOME names another folder)")
    return engine


class UsageError(Exception):
    """Arguments or input files the user can fix: said on one line, status 2, no traceback."""


def _home() -> Path:
    return Path(default_home())


def _broker(args) -> LocalBroker:
    return LocalBroker(_home() / "broker", port=args.port)


def prepare_environment(port: int = DEFAULT_PORT) -> None:
    """Points Dagster and the resources at the project home unless the caller chose otherwise."""
    home = _home()
    for name, value in (("ENTITY_ASSETS_HOME", str(home)), ("ENTITY_ASSETS_KAFKA_BOOTSTRAP", f"127.0.0.1:{port}")):
        if not os.environ.get(name, "").strip():  # set empty or blank counts as unset
            os.environ[name] = value
    if not os.environ.get("DAGSTER_HOME"):  # set and empty is unset to Dagster
        dagster_home = home / "dagster"
        instance_config(dagster_home)
        os.environ["DAGSTER_HOME"] = str(dagster_home)


COPIED = "# entity-assets copies dagster.yaml here, over this copy: edit that file, or delete this line to keep yours."
"""The first line of the project's copy of its `dagster.yaml` in the project home's instance."""


def _settings_digest(yaml: str) -> str:
    """A digest of a YAML file's lines without its comments: an older release's copy, whose
    comments said other things, is known by its settings."""
    lines = [line for line in yaml.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


RELEASED_CONFIGS = frozenset({"50c954233971f729", "02b98b1798a76ed1", "ba481c488953f1f1", "e666a02873e67027",
                              "514bb853331f38a9", "60dde406703740db"})
"""`_settings_digest` of each `dagster.yaml` the project released before its copies said so on their first
line (`git log -- dagster.yaml`): a home's copy of one is the project's, and takes this one's."""


def instance_config(dagster_home: Path) -> None:
    """The repository's `dagster.yaml` as the project home's instance's, so an upgrade's settings
    reach it; a copy whose first line is no longer `COPIED` is the user's (a Postgres storage,
    say) and stays: if it differs from the repository's, each command says so."""
    target, source = dagster_home / "dagster.yaml", REPO / "dagster.yaml"
    dagster_home.mkdir(parents=True, exist_ok=True)
    if not source.exists():
        return
    config = source.read_text()
    if target.exists() and not (held := target.read_text()).startswith(COPIED):
        if _settings_digest(held) not in {*RELEASED_CONFIGS, _settings_digest(config)}:  # the user's (none had that first line)
            print(f"entity-assets: {target} is not the copy of {source}, and is kept: delete it to take that "
                  "file's settings", file=sys.stderr)
            return
    write_file(target, f"{COPIED}\n{config}")


def kafka_resource():
    """The Kafka resource as a run gets it: its `EnvVar`s (the SASL credentials) resolved, which
    Dagster does for runs and sensors but not for a resource used outside them."""
    from entity_assets.definitions import build_resources

    return build_resources()["kafka"].process_config_and_initialize()


def _on_the_embedded_broker(broker: LocalBroker) -> None:
    """`broker start` and `demo` create topics and produce sample traffic on the broker they
    start: a cluster's bootstrap servers left in the shell (ENTITY_ASSETS_KAFKA_BOOTSTRAP, or
    the client config's `bootstrap.servers`) would take them."""
    named = kafka_resource().config()["bootstrap.servers"]
    if named.replace("localhost:", "127.0.0.1:") != broker.bootstrap:
        raise UsageError(f"the Kafka settings name {named}, not the embedded broker at {broker.bootstrap}: unset "
                         "ENTITY_ASSETS_KAFKA_BOOTSTRAP (and bootstrap.servers in ENTITY_ASSETS_KAFKA_CLIENT_CONFIG) "
                         "for the embedded broker (a cluster's topics: `entity-assets topics`)")


def cmd_broker(args) -> int:
    broker = _broker(args)
    if args.action == "start":
        _on_the_embedded_broker(broker)
        pid = broker.start()
        from entity_assets.kafka_io import ensure_topics

        kafka = kafka_resource()
        created = ensure_topics(kafka.config(), [kafka.topic(s) for s in INPUT_STREAMS], args.partitions)
        print(f"broker on {broker.bootstrap} (pid {pid}, data {broker.data_dir}); created topics: {created or 'none'}")
    elif args.action == "stop":
        print("stopped" if broker.stop() else "not running")
    else:
        print(json.dumps(broker.status()))
    return 0


def cmd_topics(args) -> int:
    """Creates the topics the project reads and writes that the cluster lacks, with their settings,
    and lists them: for clusters whose clients may not create topics, or to review the settings."""
    from entity_assets.kafka_io import cluster_metadata, ensure_topics, partition_counts
    from resources.kafka import DERIVED_STREAMS

    if bad := [kv for kv in args.input_config if "=" not in kv]:
        raise UsageError(f"--input-config {bad[0]}: give KEY=VALUE, e.g. retention.ms=-1")
    kafka = kafka_resource()
    config = kafka.config()
    cluster_metadata(config)  # no answer: the error at once, as `produce` gives it
    input_settings = dict(kv.split("=", 1) for kv in args.input_config)
    inputs = {kafka.topic(s): input_settings for s in INPUT_STREAMS}
    outputs = {kafka.topic(s): kafka.new_topic_settings(s) for s in DERIVED_STREAMS if kafka.publishes(s)}
    created = set() if args.dry_run else {
        *ensure_topics(config, inputs, args.partitions, topic_configs=inputs,
                       replication_factor=kafka.new_topic_replication_factor),
        *ensure_topics(config, outputs, kafka.new_topic_partitions, topic_configs=outputs,
                       replication_factor=kafka.new_topic_replication_factor)}
    held = partition_counts(config, [*inputs, *outputs])
    replicas = kafka.new_topic_replication_factor
    replicas = "the cluster's default replicas" if replicas == -1 else f"{replicas} replicas"
    for role, topics, partitions in (("input", inputs, args.partitions), ("output", outputs, kafka.new_topic_partitions)):
        for topic, settings in topics.items():
            if topic in held and topic not in created:
                print(f"{topic:<40} {role:<6} exists, {held[topic]} partitions")
                continue
            shown = ",".join(f"{k}={v}" for k, v in settings.items()) or "broker defaults"
            print(f"{topic:<40} {role:<6} {'created' if topic in created else 'would be created'}: "
                  f"{partitions} partitions, {replicas}, {shown}")
    return 0


def cmd_spark(args) -> int:
    from entity_assets.spark_connect import LocalSparkConnect

    conf = ()
    if args.action == "start":  # stop and status read no setting: one that is not valid does not stop them
        from entity_assets.definitions import build_resources

        conf = tuple(build_resources()["spark"].conf.items())
    server = LocalSparkConnect(_home() / "spark", port=args.spark_port, conf=conf)
    if args.action == "start":
        pid = server.start(timeout=180)
        print(f"spark connect server (pid {pid}, log {server.log_file}); connect with:", file=sys.stderr)
        print(server.url)  # alone on stdout: ENTITY_ASSETS_SPARK_MASTER=$(entity-assets spark start)
    elif args.action == "stop":
        print("stopped" if server.stop() else "not running")
    else:
        print(json.dumps({**server.status(), "url": server.url}))
    return 0


def produce_records(records, kafka=None, streams: set[str] | None = None) -> Counter:
    """Produces (stream, key, value) records to their topics; returns counts per stream.

    Kafka is asked for its metadata first: a producer would wait minutes for a broker that is
    not there before it failed. `streams`, when given, must all have their topic already: a
    misspelt one, or one under a new prefix, would be created by a broker that creates topics on
    first use, with its defaults, or never read."""
    from entity_assets.kafka_io import cluster_metadata, produce

    kafka = kafka or kafka_resource()
    held = cluster_metadata(kafka.config()).topics
    if missing := sorted(kafka.topic_named(s) for s in streams or () if kafka.topic_named(s) not in held):
        raise UsageError(f"no topic {', '.join(missing)} on the cluster: `entity-assets topics` creates the input "
                         f"topics ({', '.join(INPUT_STREAMS)}); a connector creates its ingestion topics")
    counts: Counter = Counter()
    # streamed, one producer per run of records of one stream: memory stays flat in N
    for stream, run in groupby(records, key=lambda r: r[0]):
        counts[stream] += produce(kafka.config(), kafka.topic_named(stream), ((k, v) for _, k, v in run))
    return counts


def _cdc_topics(partitions: int = 4) -> None:
    """The sample's ingestion topics: a connector creates its own; the sample's are made here,
    once Kafka answers (`cluster_metadata` names the cause of a silence in seconds)."""
    from entity_assets import samples
    from entity_assets.kafka_io import cluster_metadata, ensure_topics

    kafka = kafka_resource()
    cluster_metadata(kafka.config())
    ensure_topics(kafka.config(), [kafka.topic(s) for s in samples.CDC_STREAMS], partitions)


def _no_constant(name: str):
    raise ValueError(f"{name} is no JSON value")


def _finite(text: str) -> float:
    """A JSON number as a float, which one past a double is not: sent again, it would read `Infinity`."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:40]} is beyond a double")
    return value


def _file_records(path: str):
    """(stream, key, value) of each line of a JSON-lines file of {topic, key, value}: a topic that
    an input stream or a configured source's ingestion reads."""
    kafka = kafka_resource()
    lines = 0
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line, parse_constant=_no_constant, parse_float=_finite)
                    if not isinstance(r, dict):
                        raise TypeError(f"a JSON {type(r).__name__}, not an object")
                    if not isinstance(r["topic"], str):
                        raise TypeError(f"topic is {json.dumps(r['topic'])[:80]}, not a name")
                    if kafka.input_stream(kafka.topic_named(r["topic"])) is None:
                        raise TypeError(f"{r['topic'][:120]} is neither an input stream ({', '.join(INPUT_STREAMS)}) "
                                        "nor the ingestion topic of a configured source")
                    lines += 1
                    # JSON text of what is not a string (a CDC key object); a null value is a tombstone
                    value, key = (v if v is None or isinstance(v, str) else json.dumps(v) for v in (r["value"], r.get("key")))
                    yield r["topic"], key, None if value is None else value.encode()
                except (ValueError, TypeError, KeyError) as exc:
                    what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
                    raise UsageError(f"{path}:{number}: {what} (each line: {{topic, key, value}})") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from None
    if not lines:
        raise UsageError(f"{path}: no record (each line: {{topic, key, value}})")


def _say_produced(counts: Counter) -> None:
    print("produced " + ", ".join(f"{n} to {s}" for s, n in sorted(counts.items())))


def cmd_produce(args) -> int:
    from entity_assets import samples

    if args.seed is None and args.source in ("sample", "cdc"):
        args.seed = int.from_bytes(os.urandom(4), "big") >> 1
        print(f"seed {args.seed} (--seed {args.seed} produces these records again)")
    if args.source == "cdc":
        _cdc_topics()
        counts = produce_records(samples.CdcTraffic(rows=args.rows, seed=args.seed).records())
    elif args.source == "file":
        if not args.path:
            raise UsageError("produce file needs a path: JSON lines of {topic, key, value}")
        # read twice, so that a bad line or topic stops it before anything is produced
        counts = produce_records(_file_records(args.path),
                                 streams={stream for stream, _, _ in _file_records(args.path)})
    elif args.source == "seed":
        counts = produce_records(samples.seed_records(), streams=set(INPUT_STREAMS))
    else:
        zones = tuple(f"zone-{i}" for i in range(args.zones)) if args.zones else samples.BatchTraffic.zones
        traffic = samples.BatchTraffic(patches=args.patches, entities=args.entities, ops=args.ops, seed=args.seed,
                                       learning=args.learning, zones=zones)
        if args.devices:
            traffic = samples.GraphTraffic(traffic, devices=args.devices)
        if args.source == "acks":
            if not args.devices:
                raise UsageError("produce acks needs --devices: the sample's devices, every third of which acknowledges")
            counts = produce_records(traffic.acks(), streams=set(INPUT_STREAMS))
        else:
            counts = produce_records(traffic.changes() if args.devices else traffic.records(),
                                     streams=set(INPUT_STREAMS))
        if args.bad:
            counts += produce_records(("entity-batches", f"bad/{i}", v) for i, (_, v) in enumerate(samples.BAD_VALUES))
    _say_produced(counts)
    return 0


class RunRefused(UsageError):
    """Slices or assets to run again that are none: nothing runs."""


class RunsInFlight(Exception):
    """Slices are being applied outside this process; `run` beside them would break slice order."""


def _close(instance) -> None:
    """Closes the instance's pooled SQLite connections (`instance_storage`): a run file left open
    keeps its events in its -wal file, and the instance's dispose leaves the schedule storage's."""
    instance.dispose()
    if instance.schedule_storage is not None:
        instance.schedule_storage.dispose()


def _instance_for_runs():
    """The Dagster instance, once no slice is being applied elsewhere in it (RunsInFlight otherwise)."""
    from dagster import DagsterInstance, DagsterInvariantViolationError

    from entity_assets.launcher import settle_runs
    from entity_assets.partitions import LAKE_POOL
    from entity_assets.sensors import kafka_offsets_sensor

    try:
        instance = DagsterInstance.get()
    except DagsterInvariantViolationError as exc:  # DAGSTER_HOME not a folder
        raise UsageError(str(exc)) from None
    atexit.register(_close, instance)
    home = Path(os.environ["DAGSTER_HOME"])
    if not (home / "dagster.yaml").exists():  # installed from a wheel, away from the repository, say
        print(f"entity-assets: no dagster.yaml in DAGSTER_HOME ({home}): runs are recorded in a default instance, "
              "without the lake pool or run monitoring, which a deployment's daemon does not see; set DAGSTER_HOME "
              "to your instance's folder", file=sys.stderr)
    elif os.environ.get("ENTITY_ASSETS_LAKE", "").strip() and home == _home() / "dagster":
        print(f"entity-assets: runs of the lake {os.environ['ENTITY_ASSETS_LAKE']} are recorded in the project's own "
              f"instance ({home}), and only its runs in flight are waited for: if a daemon runs this lake's slices, "
              "set DAGSTER_HOME to its instance", file=sys.stderr)
    elif home == _home() / "dagster" and LAKE_POOL not in instance.event_log_storage.get_concurrency_keys():
        instance.event_log_storage.set_concurrency_slots(LAKE_POOL, 1)  # as scripts/ui.sh does, for a daemon later
    blockers = settle_runs(instance, kafka_offsets_sensor.name)
    if blockers:
        raise RunsInFlight(blockers)
    return instance


def run_pending(*, max_messages: int | None = None, log=print, steps: list[str] | None = None) -> list[dict]:
    """One sensor evaluation, then every slice not done, in slice order: without a successful run
    since it closed, or that the lake lacks (restored from a backup).

    Runs go through the same job the daemon launches, recorded in the Dagster instance, but in
    this process rather than through the daemon's queue, so they start only when the instance
    has no unfinished run of the lake pool and no daemon running the sensor (RunsInFlight otherwise).
    `steps` limits the runs to those steps (ops) of the job, e.g. the entity core only.
    """
    from dagster import AssetKey, build_sensor_context

    from entity_assets.definitions import build_resources
    from entity_assets.manifests import ManifestStore
    from entity_assets.sensors import (adopted, done, dump_cursor, kafka_offsets_sensor, lake_holds, not_the_lake,
                                       slice_runs, successful_slice_runs)
    from entity_assets.slices import run_key, slice_key
    from entity_assets.tables import APPLIED_IN_ORDER

    instance = _instance_for_runs()
    resources = build_resources()
    slicing = resources["slicing"]  # its other settings (offsets_went_back, ...) hold
    resources["slicing"] = with_settings(slicing, min_interval_seconds=0, max_messages=max_messages or slicing.max_messages)
    store = ManifestStore(resources["lake"].open())
    newest = store.latest()
    if newest is None and (ran := len({seq for seq, _ in successful_slice_runs(instance)})):
        raise UsageError(not_the_lake(store.engine.root, f"this Dagster instance ran {ran} slice(s)"))
    cursor = dump_cursor(newest.seq, newest.positions(), newest.closed_at) if newest else None
    # the tick's lag report is not stored, nor its commit made: `_report_lag` does both after the runs
    ticking = {**resources, "kafka": with_settings(resources["kafka"], commit_offsets=False)}
    with build_sensor_context(instance=instance, cursor=cursor, resources=ticking) as context:
        result = kafka_offsets_sensor(context)
    log(f"sensor: {result.skip_reason.skip_message if result.skip_reason else f'{len(result.run_requests)} new slice(s)'}")

    # a slice is done when its run succeeded after it closed and the lake holds it: a lake
    # restored from a backup may lack slices whose runs succeeded
    selection = _steps_selection(steps)
    closed = store.closed_at()
    runs = slice_runs(instance, closed)
    tables = [t for t in APPLIED_IN_ORDER if selection is None or AssetKey(t) in selection]
    holds = lake_holds(store.engine, tables) if tables else max(closed, default=0)  # no state step: nothing to hold
    taken = adopted(runs, store.engine)
    if taken:
        log(f"this Dagster instance has run no slice, and the lake's every state holds slices up to "
            f"{slice_key(taken)}: taken as done")
    newest_done = max((seq for seq in closed if seq <= taken or done(runs, seq, holds)), default=0)
    undone = [seq for seq in sorted(closed) if seq > taken and not done(runs, seq, holds)]
    if passed := [seq for seq in undone if seq < newest_done]:
        # as the sensor: slices after them applied, so the state holds them; a replay now could not
        # read the state before them once the vacuum has gone past, and would hold back every new slice
        log(f"warning: {len(passed)} slice(s) without a successful run before slice {slice_key(newest_done)}, "
            f"which has one, left as they are: {', '.join(map(slice_key, passed[:5]))}"
            f"{' ...' if len(passed) > 5 else ''} (`run --slices N` runs one again)")
    pending = [(slice_key(seq), run_key(slice_key(seq), closed[seq])) for seq in undone if seq > newest_done]
    summaries = _materialize(instance, store, pending, selection, log)
    if pending:
        _report_lag(instance, resources, log)
    return summaries


def _report_lag(instance, resources: dict, log) -> None:
    """The lag after the runs (`sensors.report_lag`): observed, committed, and said in one line."""
    from entity_assets.kafka_io import KafkaUnreachable
    from entity_assets.manifests import ManifestStore
    from entity_assets.sensors import report_lag
    from entity_assets.slices import slice_key

    store = ManifestStore(resources["lake"].open())
    kafka = resources["kafka"].process_config_and_initialize()  # its EnvVars (SASL credentials) resolved
    try:
        marks = kafka.input_watermarks()
    except KafkaUnreachable as exc:  # the runs are done: their status is not the report's
        log(f"warning: lag not reported: {exc}")
        return
    observations, state = report_lag(lambda text: log(f"warning: {text}"), instance, kafka, store, marks,
                                     store.latest_seq(), None)
    for event in observations:
        instance.report_runless_asset_event(event)
    if observations:  # none: caught up as the tick saw it, or the report failed (a warning said why)
        behind = {o.asset_key.path[-1]: o.metadata["lag"].value for o in observations}
        holds = state["holds"]
        log(f"lag: {sum(behind.values())} messages on the input topics past slice "
            f"{slice_key(holds) if holds else '(none)'}" + "".join(f", {n} on {s}" for s, n in behind.items() if n))


def run_slices(first: int, last: int, *, assets: list[str] | None = None, republish: bool = False,
               log=print) -> list[dict]:
    """Materializes slices `first`..`last` again, in order, whatever their runs so far: the rebuild
    of a table deleted after an upgrade (docs/operations.md), or slices re-run after a fix.

    One run per slice in this process, as `run_pending` makes them: a backfill through the
    daemon starts a process per slice, which costs each small slice ~4 s more (bench/README.md).
    `assets`: those assets (with the other assets of their steps) instead of the whole graph.
    `republish`: publish slices older than the newest published too (`assets.common.publishes_slice`).
    """
    from entity_assets.assets.common import REPUBLISH_TAG
    from entity_assets.manifests import ManifestStore
    from entity_assets.slices import run_key, slice_key

    if first > last:
        raise RunRefused(f"slices {first}..{last}: the first comes after the last")
    steps = None
    if assets is not None:
        ops = {key.to_user_string(): op for key, op in _step_of_asset().items()}
        unknown = sorted(set(assets) - set(ops))
        if unknown or not assets:
            raise RunRefused(f"no asset {', '.join(unknown) or 'named'}; the assets are {', '.join(sorted(ops))}")
        steps = sorted({ops[a] for a in assets})
    store = ManifestStore(_lake(), reading=True)
    closed = store.closed_at()
    latest = max(closed, default=0)
    if not 1 <= first <= last <= latest:
        raise RunRefused(f"slices {first}..{last} do not exist: the sensor has closed slices 1..{latest}")
    instance = _instance_for_runs()
    runs = [(slice_key(s), run_key(slice_key(s), closed[s])) for s in range(first, last + 1)]
    return _materialize(instance, store, runs, _steps_selection(steps), log,
                        tags={REPUBLISH_TAG: "true"} if republish else {})


def _step_of_asset() -> dict:
    """The step (op) of slice_job that materializes each asset, by asset key (the Kafka topics, external, have none)."""
    from entity_assets.definitions import defs

    return {key: defs.resolve_assets_def(key).op.name for key in defs.resolve_asset_graph().materializable_asset_keys}


def _steps_selection(steps: list[str] | None):
    """The asset keys of those steps (ops) of slice_job; None: every asset."""
    if not steps:
        return None
    return [key for key, op in _step_of_asset().items() if op in steps]


def _materialize(instance, store, runs: list[tuple[str, str]], selection, log, tags: dict | None = None) -> list[dict]:
    """One slice_job run per (slice key, run key), in order, until one fails: later slices would
    be refused, as state applies in slice order. Each is tagged as the sensor tags its runs. Before
    each slice but the first, the instance is checked again (`launcher.settle_runs`): the daemon
    may have started a run of the lake pool (a maintenance, a backfill) between two of them."""
    from entity_assets.definitions import defs
    from entity_assets.launcher import settle_runs, worker_tag
    from entity_assets.sensors import kafka_offsets_sensor, slice_tags
    from entity_assets.slices import slice_seq

    keys = [key for key, _ in runs]
    for at in range(0, len(keys), 1000):  # one IN list each: SQLite builds may bound its variables (32,766)
        instance.add_dynamic_partitions("slices", keys[at:at + 1000])
    manifests = store.get_many(slice_seq(key) for key, _ in runs)
    job = defs.resolve_job_def("slice_job")
    summaries = []
    for key, run in runs:
        if summaries and (blockers := settle_runs(instance, kafka_offsets_sensor.name)):
            raise RunsInFlight([*blockers, f"(stopped before slice {key}; the slices before it are done)"])
        started = time.monotonic()
        outcome = job.execute_in_process(partition_key=key, instance=instance, raise_on_error=False,
                                         tags={"dagster/run_key": run, **worker_tag(), **slice_tags(manifests[slice_seq(key)]),
                                               **(tags or {})},
                                         asset_selection=selection)
        materialized = Counter()
        for event in outcome.get_asset_materialization_events():
            mat = event.event_specific_data.materialization
            rows = mat.metadata.get("rows")
            materialized[mat.asset_key.to_user_string()] = rows.value if rows else 0
        step_seconds = {e.step_key: round(e.event_specific_data.duration_ms / 1000, 2)
                        for e in outcome.all_events if e.event_type_value == "STEP_SUCCESS"}
        summary = {"slice": key, "run_id": outcome.run_id, "success": outcome.success,
                   "seconds": round(time.monotonic() - started, 1), "rows": dict(materialized), "steps": step_seconds}
        log(f"slice {key}: {'ok' if outcome.success else 'FAILED'} in {summary['seconds']}s run {outcome.run_id[:8]} "
            + " ".join(f"{k}={v}" for k, v in materialized.items()))
        summaries.append(summary)
        if not outcome.success:
            break
    return summaries


def _run_all(runs=run_pending) -> int:
    """0 when every slice run succeeded, 1 when one failed, 2 when refused (RunsInFlight, or slices
    or assets that do not exist)."""
    try:
        summaries = runs()
    except RunsInFlight as e:
        print("not running: runs of the lake pool (slices, or lake_maintenance) are in flight elsewhere in this "
              "instance, and state applies in slice order:\n  " + "\n  ".join(e.args[0]) + "\nLet them finish "
              "(the daemon: scripts/ui.sh), or terminate them and turn the sensor off in the UI.", file=sys.stderr)
        return 2
    except RunRefused as e:
        print(f"not running: {e}", file=sys.stderr)
        return 2
    return 0 if all(s["success"] for s in summaries) else 1


def cmd_run(args) -> int:
    if args.slices is None:
        if args.assets is not None or args.republish:
            print(f"{'--assets' if args.assets is not None else '--republish'} needs --slices: pending slices run "
                  "through the whole graph, and publish", file=sys.stderr)
            return 2
        return _run_all(lambda: run_pending(max_messages=args.max_messages))
    first, dots, last = args.slices.partition("..")
    if not (_whole(first) and (_whole(last) if dots else True)):
        print(f"--slices {args.slices}: give slice numbers, FIRST or FIRST..LAST", file=sys.stderr)
        return 2
    if args.max_messages is not None:
        print("--max-messages cuts new slices: slices run again keep the offsets they closed with", file=sys.stderr)
        return 2
    assets = None if args.assets is None else [a.strip() for a in args.assets.split(",") if a.strip()]
    return _run_all(lambda: run_slices(int(first), int(last or first), assets=assets, republish=args.republish))


def cmd_maintenance(args) -> int:
    """`lake_maintenance` in this process, for a deployment that runs slices without the daemon
    (cron and `run`), whose schedule then never fires; in the lake pool, and only when no slice
    is being applied elsewhere, as `run` (a vacuum deletes files a running slice has not committed)."""
    from entity_assets.definitions import build_resources
    from entity_assets.launcher import worker_tag
    from entity_assets.maintenance import lake_maintenance

    def maintain() -> list[dict]:
        result = lake_maintenance.execute_in_process(instance=_instance_for_runs(), tags=worker_tag(),
                                                     resources={"lake": build_resources()["lake"]},
                                                     raise_on_error=False)
        vacuumed = sum(o.metadata["vacuumed_files"].value + o.metadata["expired_log_files"].value
                       for o in _observations(result))
        print(f"lake_maintenance: {'done' if result.success else 'failed'} (run {result.run_id}): {vacuumed} file(s) "
              "of the asset tables deleted")
        return [{"success": result.success}]

    return _run_all(maintain)


def _observations(result) -> list:
    from dagster import DagsterEventType

    return [e.event_specific_data.asset_observation for e in result.all_events
            if e.event_type == DagsterEventType.ASSET_OBSERVATION]


def lake_summary() -> dict[str, dict]:
    from entity_assets.manifests import TABLE as MANIFESTS
    from entity_assets.tables import SCHEMAS

    engine = _lake()  # a folder, or a bucket or container: the tables by their names
    out = {}
    for table in sorted(t for t in (*SCHEMAS, MANIFESTS) if engine.exists(t)):
        out[table] = {"rows": engine.row_count(table), "version": engine.version(table)}
    if "dead_letters" in out and out["dead_letters"]["rows"]:
        out["dead_letters"]["codes"] = _value_counts(engine, "dead_letters", "code")
    if "entity_batches" in out and out["entity_batches"]["rows"]:  # native batches and each CDC ingestion topic
        out["entity_batches"]["topics"] = dict(sorted(_value_counts(engine, "entity_batches", "kafka_topic").items()))
    return out


def _value_counts(engine, table: str, column: str) -> dict:
    """A column's values and their counts, a file at a time: an input table is kept for good."""
    import pyarrow.compute as pc

    from entity_assets.storage import read_tables

    counts: Counter = Counter()
    for data in read_tables(engine.files(table), engine.storage_options, [column]):
        counts.update({c["values"]: c["counts"] for c in pc.value_counts(data.column(column)).to_pylist()})
    return dict(counts)


def cmd_summary(args) -> int:
    summary = lake_summary()
    width = max((len(t) for t in summary), default=10)
    print(f"{'table':<{width}}  {'rows':>10}  delta version")
    for table, s in summary.items():
        extra = "".join(f"  {s[k]}" for k in ("codes", "topics") if s.get(k))
        print(f"{table:<{width}}  {s['rows']:>10}  v{s['version']}{extra}")
    return 0


def cmd_trace(args) -> int:
    from entity_assets.definitions import build_resources
    from entity_assets.trace import format_trail, parse_record, trace

    resources = build_resources()
    try:
        record = parse_record(args.record, resources["kafka"].topic_named)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    trail = trace(_lake(), *record)
    print(json.dumps(asdict(trail), indent=2) if args.json else format_trail(trail))
    return 0 if trail.slice else 1


CHANGING_STATES = ("entities", "schemas", "devices", "device_inboxes")
"""The state tables whose keys stay as rows once written (a deletion sets `deleted`), so their
changes since a slice are complete (docs/storage.md)."""


def cmd_changes(args) -> int:
    from entity_assets.slices import slice_key

    if args.since is not None and not _whole(args.since):
        raise UsageError(f"--since {args.since}: give a slice number")
    engine = _lake()
    if not engine.exists(args.table):
        raise SystemExit(f"entity-assets changes: the lake has no {args.table} table yet")
    from entity_assets.assets.common import STATE_APP
    from entity_assets.trace import printable

    since = None if args.since is None else slice_key(int(args.since))
    version = engine.version(args.table)  # one snapshot: the rows, and the slice to go on from
    for table in engine.changes(args.table, since, version):
        for row in table.drop_columns(["bucket"]).to_pylist():
            print(printable(json.dumps(row, ensure_ascii=False)))  # a client's text as JSON escapes
    upto = engine.applied(args.table, STATE_APP, version)
    print(f"changes of {args.table} as of slice {slice_key(upto or 0)}: next, --since {upto or 0}", file=sys.stderr)
    return 0


def cmd_history(args) -> int:
    from entity_assets.history import Diverged, as_of, entity_history
    from entity_assets.trace import printable

    try:
        history = entity_history(_lake(), args.dbid, args.collection, args.zone, args.entity)
    except Diverged as exc:
        raise SystemExit(f"entity-assets history: {exc}") from None
    if args.slice is None and args.at is None:
        for v in history:  # marked: `--at` never reads a version of no length (docs/entity-core.md)
            zero = "  (zero-length: the next update had ended by then)" if v["valid_to"] == v["valid_from"] else ""
            print(printable(json.dumps(v, ensure_ascii=False) if args.json else
                  f"v{v['version']}  slice {v['slice']}  valid {v['valid_from']}..{v['valid_to'] or ''}{zero}  "
                  f"{v['action']} by {v['clientid']}/{v['request']}/{v['part']}  "
                  + ("(deleted)" if v["deleted"] else json.dumps(v["document"], ensure_ascii=False))))
    else:
        found = as_of(history, slice=args.slice, time=args.at)
        if found is not None:
            print(printable(json.dumps(found, ensure_ascii=False) if args.json else
                  json.dumps(found["document"], ensure_ascii=False)))
            return 0
        if history:  # silence would not tell "not yet" from a key mistyped
            first, when = history[0], f"after slice {args.slice}" if args.at is None else f"at {args.at}"
            print(f"entity-assets history: no version {when} (the first: v{first['version']}, slice "
                  f"{first['slice']}, from {first['valid_from']})", file=sys.stderr)
    if not history:  # silence would not tell a mistyped key from an entity not there yet
        print(f"entity-assets history: no version of {args.dbid}/{args.collection}/{args.zone}/{args.entity} in "
              "entity_updates (the key's four parts are case-sensitive)", file=sys.stderr)
    return 0 if history and (args.slice is None and args.at is None) else 1


def _a_notifying_record() -> str | None:
    """TOPIC:PARTITION:OFFSET of a record whose change reached a device, for the demo's hint."""
    from entity_assets.definitions import build_resources
    from entity_assets.storage import read_table

    engine = build_resources()["lake"].open()
    files = [f for f in engine.files("changes_by_device") if f.rows] if engine.exists("changes_by_device") else []
    if not files:
        return None
    first = read_table(files[0], engine.storage_options, ["kafka_topic", "kafka_partition", "kafka_offset"]).slice(0, 1)
    return ":".join(str(first[c][0].as_py()) for c in first.column_names)


def _an_entity_of_many_versions() -> str | None:
    """`history`'s arguments for the entity with the most versions, for the demo's hint, quoted for
    a shell (a `$zoneSubscription` entity's collection)."""
    import shlex

    from entity_assets.core import ENTITY_KEY
    from entity_assets.definitions import build_resources

    engine = build_resources()["lake"].open()
    if not engine.exists("entities"):
        return None
    rows = engine.read("entities", columns=[*ENTITY_KEY, "version"]).to_pylist()
    most = max(rows, key=lambda r: (r["version"], *(r[c] for c in ENTITY_KEY)), default=None)
    return None if most is None else " ".join(shlex.quote(most[c]) for c in ENTITY_KEY)


def cmd_demo(args) -> int:
    lake = os.environ.get("ENTITY_ASSETS_LAKE", "").strip()
    if lake and Path(lake).resolve() != (_home() / "lake").resolve():
        raise UsageError(f"ENTITY_ASSETS_LAKE names {lake}: the demo's sample traffic goes to the home's own lake "
                         f"({_home() / 'lake'}); unset it, or give the demo another ENTITY_ASSETS_HOME")
    args.action = "start"
    cmd_broker(args)
    from entity_assets import samples

    traffic = samples.GraphTraffic(samples.BatchTraffic(patches=args.patches, entities=args.entities, learning=True),
                                   devices=args.devices)
    _cdc_topics(args.partitions)
    counts = produce_records([*samples.seed_records(), *traffic.changes(),
                              *(("entity-batches", f"bad/{i}", v) for i, (_, v) in enumerate(samples.BAD_VALUES)),
                              *samples.CdcTraffic(rows=args.cdc_rows).records(), samples.CDC_BAD])
    _say_produced(counts)
    code = _run_all()
    if code == 0:  # the apps acknowledge what those slices sent them: a slice of its own
        counts = produce_records(traffic.acks())
        _say_produced(counts)
        code = _run_all()
    print()
    cmd_summary(args)
    print(f"\nDagster home: {os.environ['DAGSTER_HOME']}\nOpen the UI:  scripts/ui.sh   (then http://127.0.0.1:3000)")
    notified = _a_notifying_record()
    if notified:
        print(f"Follow one record down to the devices it notified:  .venv/bin/entity-assets trace {notified}")
    entity = _an_entity_of_many_versions()
    if entity:
        print(f"Read an entity's versions (--slice N or --at MS: as of then):  .venv/bin/entity-assets history {entity}")
    return code


def _whole(text: str) -> bool:
    """Whether `text` is a whole number as the user types one: `str.isdigit` also takes `²`,
    which `int` refuses."""
    return text.isascii() and text.isdigit()


def _port_of(variable: str, default: int) -> dict:
    """The type and default of a port option whose default `variable` sets: a value that is no
    port, given or from the environment, is a usage error (status 2) naming both."""
    def port(text: str) -> int:
        if not _whole(text) or not 0 < int(text) < 65536:
            raise argparse.ArgumentTypeError(f"{text!r} is not a port (the default comes from {variable})")
        return int(text)

    return {"type": port, "default": os.environ.get(variable, "").strip() or str(default)}


def _at_least(minimum: int):
    """An option's type: a whole number of at least `minimum`; less is a usage error, not a
    default nor a traceback of the sample's generator."""
    def count(text: str) -> int:
        if not _whole(text) or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a count of {minimum} or more")
        return int(text)

    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="entity-assets", description=__doc__.split("\n")[0],
                                     epilog=__doc__.split("\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", **_port_of("ENTITY_ASSETS_BROKER_PORT", DEFAULT_PORT),
                        help="the local broker's port (before the command; ENTITY_ASSETS_BROKER_PORT)")
    sub = parser.add_subparsers(dest="command", required=True)
    broker = sub.add_parser("broker", help="start, stop or inspect the local broker")
    broker.add_argument("action", choices=["start", "stop", "status"])
    broker.add_argument("--partitions", type=_at_least(1), default=4, help="partitions of the input topics it creates")
    topics = sub.add_parser("topics", help="create the input and output topics the cluster lacks, and list them")
    topics.add_argument("--partitions", type=_at_least(1), default=4, help="partitions of the input topics it creates "
                        "(output topics: KafkaResource.new_topic_partitions)")
    topics.add_argument("--input-config", action="append", default=[], metavar="KEY=VALUE",
                        help="a topic setting of the input topics it creates (repeatable), e.g. retention.ms=-1")
    topics.add_argument("--dry-run", action="store_true", help="list what would be created; create nothing")
    spark = sub.add_parser("spark", help="start, stop or inspect the local Spark Connect server")
    spark.add_argument("action", choices=["start", "stop", "status"])
    spark.add_argument("--spark-port", **_port_of("ENTITY_ASSETS_SPARK_CONNECT_PORT", SPARK_CONNECT_PORT),
                       help="the local Spark Connect server's port (ENTITY_ASSETS_SPARK_CONNECT_PORT)")
    produce = sub.add_parser("produce", help="produce records to the input topics")
    produce.add_argument("source", choices=["sample", "seed", "file", "cdc", "acks"],
                         help="cdc: change data capture of four source systems (Debezium, GoldenGate, DB2, Qlik); "
                              "acks: the sample's acknowledgements (--devices), after the slices that notified them")
    produce.add_argument("path", nargs="?", help="JSONL of {topic, key, value} (for 'file')")
    produce.add_argument("--patches", type=_at_least(1), default=10_000)
    produce.add_argument("--entities", type=_at_least(1), default=1_000)
    produce.add_argument("--ops", type=_at_least(1), default=3)
    produce.add_argument("--seed", type=int, default=None,
                         help="sample, cdc: the traffic's random seed (default: a new one, printed); a seed given "
                              "again produces the same request ids, which the pipeline drops as redeliveries")
    produce.add_argument("--learning", action="store_true")
    produce.add_argument("--devices", type=_at_least(0), default=0, help="whole-graph traffic: schemas, devices, subscriptions")
    produce.add_argument("--zones", type=_at_least(0), default=0, help="spread entities and subscriptions over this many zones")
    produce.add_argument("--bad", action="store_true", help="add bad records (malformed JSON, invalid fields, a wrong type), which become dead letters")
    produce.add_argument("--rows", type=_at_least(1), default=100, help="cdc: rows of each source's projection")
    run = sub.add_parser("run", help="evaluate the sensor and materialize every pending slice in order")
    run.add_argument("--max-messages", type=_at_least(1), default=None, help="cap of messages per slice")
    run.add_argument("--slices", metavar="FIRST[..LAST]", default=None,
                     help="materialize these closed slices again, in order (numbers), instead of the pending ones")
    run.add_argument("--assets", metavar="NAME[,NAME]", default=None,
                     help="with --slices: only these assets (and the other assets of their steps)")
    run.add_argument("--republish", action="store_true",
                     help="with --slices: publish slices older than the newest published too (their messages "
                          "overtake newer ones of the same keys), e.g. messages left out as too large")
    sub.add_parser("maintenance", help="vacuum the lake and expire its old log files (lake_maintenance), as the "
                                       "daemon's daily schedule does, for deployments without the daemon")
    sub.add_parser("summary", help="rows per table and dead letters per code")
    trace_ = sub.add_parser("trace", help="one input record's rows in every table, down to the notified devices' inboxes")
    trace_.add_argument("record", metavar="TOPIC:PARTITION:OFFSET",
                        help="its Kafka coordinates; an input stream's name stands for its topic (e.g. entity-batches:0:17)")
    trace_.add_argument("--json", action="store_true", help="every column of every row, as JSON")
    changes = sub.add_parser("changes", help="a state's rows that the slices after --since changed, each key once, as JSON lines")
    changes.add_argument("table", choices=CHANGING_STATES)
    changes.add_argument("--since", metavar="SLICE", default=None,
                         help="a slice number: rows a later slice changed (default: every row)")
    history = sub.add_parser("history", help="an entity's versions from entity_updates, or its document as of a slice or time")
    for name in ("dbid", "collection", "zone", "entity"):
        history.add_argument(name)
    when = history.add_mutually_exclusive_group()
    when.add_argument("--slice", type=_at_least(1), default=None, help="the document after this slice (its number)")
    when.add_argument("--at", type=_at_least(0), metavar="MS", default=None,
                      help="the document at this time (epoch milliseconds, as begun and ended)")
    history.add_argument("--json", action="store_true", help="each version with every field, as JSON lines")
    demo = sub.add_parser("demo", help="broker, sample traffic, every slice, summary")
    demo.add_argument("--patches", type=_at_least(1), default=10_000)
    demo.add_argument("--entities", type=_at_least(1), default=1_000)
    demo.add_argument("--devices", type=_at_least(1), default=20)
    demo.add_argument("--partitions", type=_at_least(1), default=4)
    demo.add_argument("--cdc-rows", type=_at_least(1), default=100, help="rows of each sample CDC projection")
    args = parser.parse_args(argv)
    handler = {"broker": cmd_broker, "topics": cmd_topics, "spark": cmd_spark, "produce": cmd_produce, "run": cmd_run,
               "maintenance": cmd_maintenance, "summary": cmd_summary, "trace": cmd_trace, "changes": cmd_changes,
               "history": cmd_history, "demo": cmd_demo}
    try:
        prepare_environment(args.port)
        return handler[args.command](args)
    except (KafkaUnreachable, PortInUse, NotInstalled, NotReady) as exc:  # a setting or a server to fix: no traceback
        print(f"entity-assets {args.command}: {exc}", file=sys.stderr)
        return 1
    except DeliveryFailed as exc:  # records the cluster refused (too large, a right the client lacks, no topic)
        print(f"entity-assets {args.command}: Kafka refused: {exc}", file=sys.stderr)
        return 1
    except UsageError as exc:
        print(f"entity-assets {args.command}: {exc}", file=sys.stderr)
        return 2
    except NoLake as exc:
        print(f"entity-assets {args.command}: {exc}", file=sys.stderr)
        return 1
    except DeltaError as exc:  # a table's log delta-rs cannot read (a file damaged, one of another engine's features)
        print(f"entity-assets {args.command}: the lake's Delta log: {_cause(exc)}", file=sys.stderr)
        return 1
    except (ValidationError, SettingError) as exc:  # a resource's setting from the environment (ENTITY_ASSETS_*)
        print(f"entity-assets {args.command}: a setting is not valid: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or the UI's Terminate of a run of `run` (launcher.LocalRunLauncher)
        print(f"entity-assets {args.command}: interrupted", file=sys.stderr)
        return 130
    except KafkaException as exc:
        if exc.args[0].code() == KafkaError._INVALID_ARG:  # librdkafka refused a client's settings
            print(f"entity-assets {args.command}: a Kafka client setting is not valid: {exc.args[0].str()} "
                  "(KAFKA_*, ENTITY_ASSETS_KAFKA_CLIENT_CONFIG)", file=sys.stderr)
            return 2
        # the cluster refused: a topic setting, a right the client lacks
        print(f"entity-assets {args.command}: Kafka refused: {exc.args[0].name()}: {exc.args[0].str()}",
              file=sys.stderr)
        return 1
    except BrokenPipeError:  # its output's reader ended (`| head`): nothing more to say, to no one
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:  # a lake on a store it cannot reach, or a home it cannot write
        print(f"entity-assets {args.command}: {_cause(exc)} (the lake: ENTITY_ASSETS_LAKE and its store's settings, "
              "docs/storage.md; the home: ENTITY_ASSETS_HOME)", file=sys.stderr)
        return 1


def _cause(exc: Exception) -> str:
    """An error on a line: delta-rs's object-store errors are a tree of lines, coloured, whose
    first says what failed and last why (`Connection refused`)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m|↳", "", line).strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line] or [type(exc).__name__]
    return lines[0] if len(lines) == 1 else f"{lines[0]}: {lines[-1]}"


if __name__ == "__main__":
    sys.exit(main())
