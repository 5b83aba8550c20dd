"""Helpers shared by the slice assets: running task functions on Spark, committing their files."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from functools import partial
from itertools import islice
from typing import NamedTuple

from dagster import (AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, AssetObservation, AssetSpec, Failure,
                     MetadataValue, TableColumn, TableColumnConstraints, TableSchema)
from dagster._core.storage.tags import PARENT_RUN_ID_TAG

from entity_assets import shards
from entity_assets.assets import topics
from entity_assets.core import STATE_BUCKETS
from entity_assets.fold import COUNTER, REPLACED, over_buckets, over_files, released
from entity_assets.kafka_io import (KafkaUnreachable, ensure_topics, message_limits, partition_counts, producer_limit,
                                    producer_settings)
from entity_assets.publish import OUTBOX, STREAMS, UNDELIVERABLE, Publishing, process, replay_task
from entity_assets.slices import slice_key as key_of, slice_seq
from entity_assets.storage import DataFile, DeltaRsEngine, Repeat, TableFile, filesystem, is_remote, repeated_deliveries
from entity_assets.tables import ADDED_IN_PLACE, APPLIED_IN_ORDER, COORDINATES, SCHEMAS
from resources import SparkResource


def ensure_tables(engine: DeltaRsEngine, slice_key: str, tables: Iterable[str], reads: Iterable[str] = ()) -> None:
    """Makes the tables a step writes in the run of `slice_key` and opens those it `reads`, all at
    once on an object store, where each is a few round trips."""
    writes = set(tables)
    engine.each(lambda table: engine.ensure(table, SCHEMAS[table], ADDED_IN_PLACE.get(table, ()), slice_key)
                if table in writes else engine.exists(table), [*tables, *reads])


def collect_tasks(spark: SparkResource, tasks: list[dict], fn: Callable, rows: int | None = None) -> list:
    """Runs `fn` (a mapPartitions body) over `tasks` on the executors, one Spark task each; returns what it yields.

    `rows`: what the tasks hold. Up to `SparkResource.driver_rows`, the driver runs them itself,
    one after the other, without a Spark session: a Spark job's fixed cost (~0.2 s here)
    outweighs them, and most slices of a sensor-driven deployment are that small.
    """
    if not tasks:
        return []
    if spark.on_driver(rows):
        return [out for task in tasks for out in fn(iter([task]))]

    return on_executors(spark, tasks, partial(released, fn))


def on_executors(spark: SparkResource, tasks: list, body: Callable) -> list:
    """One Spark task per item of `tasks`, running `body` (a mapPartitions body) over that item; what they yield.

    A classic session runs them as an RDD: no Spark SQL, whose first plans of a run cost the JVM
    1-2 CPU-seconds of warm-up (bench_pipeline at N = 200,000). Spark Connect has no RDDs: there
    a range of one row per partition picks each task's item, and what a task yields comes back
    pickled in a binary column (the server is warm).
    """
    session = spark.session()
    if not spark.remote:
        return session.sparkContext.parallelize(tasks, len(tasks)).mapPartitions(body).collect()
    import pickle

    def run(batches):
        import pyarrow as pa

        for batch in batches:
            for i in batch.column(0).to_pylist():
                out = [pickle.dumps(x, pickle.HIGHEST_PROTOCOL) for x in body(iter([tasks[i]]))]
                yield pa.RecordBatch.from_arrays([pa.array(out, pa.binary())], names=["out"])

    found = session.range(len(tasks), numPartitions=len(tasks)).mapInArrow(run, "out binary").toArrow()
    return [pickle.loads(b) for b in found.column(0).to_pylist()]


def run_tasks(spark: SparkResource, tasks: list[dict], fn: Callable, rows: int | None = None) -> dict[str, list[DataFile]]:
    """`collect_tasks` whose tasks report the files they wrote; returns the files by table.

    Only file records come back to the driver, never rows.
    """
    by_table: dict[str, list[DataFile]] = defaultdict(list)
    for d in collect_tasks(spark, tasks, fn, rows):
        by_table[d["table"]].append(DataFile(**d))
    return by_table


def file_tasks(files, max_rows: int, parallelism: int) -> list[dict]:
    """Tasks of whole files, {"files": [...]}: one per core on a large slice, each up to `max_rows` rows,
    and a single one on a small slice (every task has a fixed cost)."""
    total = sum(f.rows for f in files)
    target = min(max_rows, max(SMALL_TASK_ROWS, -(-total // parallelism)))
    tasks: list[dict] = []
    rows = target
    for f in files:
        if rows + f.rows > target:
            tasks.append({"files": []})
            rows = 0
        tasks[-1]["files"].append(f)
        rows += f.rows
    return tasks


SMALL_TASK_ROWS = 50_000
"""Below this many rows a task's fixed cost (worker, producer) outweighs splitting it further."""


def task_slots(spark: SparkResource, rows: int) -> int:
    """The cores to spread `rows` over; a small slice gets one task whatever Spark has, so
    asking it would start a session for nothing."""
    return spark.parallelism() if rows > SMALL_TASK_ROWS else 1


def write_stream(context, spark, kafka, slicing, engine: DeltaRsEngine, files, table: str, slice_key: str,
                 body: Callable, published: bool = True, metadata: dict[str, str] | None = None,
                 **body_args) -> tuple[dict, Counter]:
    """Runs `body` (see fold.over_files) over the rows of `files`, read by the tasks themselves: it
    writes and publishes `table`, committed here as the slice's rows (see `commit_stream`).

    `published` False: a later step publishes the table's stream, in each key's order, where
    these tasks split a key's rows by input file (entity_patches: the fold; changes_by_device:
    the inbox fold). `metadata`: more commit info (see `DeltaRsEngine.commit`).
    """
    publish_to = None
    if published:
        require_published(engine, table, slice_key)
        if publishes_slice(context, engine, table, slice_key):
            publish_to = publishing(kafka, engine, [table])
    fn = partial(over_files, body=body, slice_key=slice_key, uris={table: engine.uri(table)},
                 storage_options=engine.storage_options, publishing=publish_to, **body_args)
    rows = sum(f.rows for f in files)
    written = run_tasks(spark, file_tasks(files, slicing.max_messages_per_task, task_slots(spark, rows)), fn, rows)
    if not published:
        counts = pop_counts(written)
        return commit_slice(engine, [table], written, slice_key, published=False, metadata=metadata)[table], counts
    return commit_stream(context, spark, engine, table, written, slice_key, publish_to, metadata=metadata)


def commit_stream(context, spark, engine: DeltaRsEngine, table: str, files: dict[str, list[DataFile]], slice_key: str,
                  publish_to, counts: Counter | None = None, metadata: dict[str, str] | None = None) -> tuple[dict, Counter]:
    """Commits the slice's rows of a published table from its tasks' report, then publishes them.

    Returns the commit summary (with `published`, `published_by_table` for a step that
    publishes an earlier step's stream too, and the `undeliverable` messages the tasks named)
    and the tasks' other counters, `counts` (counters taken from the report already) included.
    """
    counts = pop_counts(files) + (counts or Counter())
    undeliverable = pop_undeliverable(files)
    summary = commit_slice(engine, [table], files, slice_key, metadata=metadata)[table]
    published = publish_outbox(spark, files, publish_to)
    observe_topics(context, slice_key, publish_to, published)
    summary["published"], summary["published_by_table"] = published[table], published
    summary["undeliverable"], summary["publishing"] = undeliverable, publish_to is not None
    record_published(engine, table, slice_key)
    return summary, counts


def commit_slice(engine: DeltaRsEngine, tables: Iterable[str], files: dict[str, list[DataFile]], slice_key: str,
                 published: bool = True, metadata: dict[str, str] | None = None) -> dict[str, dict]:
    """Replaces the slice in each table (the tables at once on an object store); returns rows and
    Delta version per table. `published`, `metadata`: see `DeltaRsEngine.replace_slice`."""
    return commit_at_once(engine, {table: partial(replace_slice, engine, table, files, slice_key, published, metadata)
                                   for table in tables})


def replace_slice(engine: DeltaRsEngine, table: str, files: dict[str, list[DataFile]], slice_key: str,
                  published: bool = True, metadata: dict[str, str] | None = None) -> dict:
    """Replaces the slice in one stream table with its files of `files`: its rows, files and Delta version."""
    written = files.get(table, [])
    return {"rows": sum(f.rows for f in written), "files": len(written),
            "version": engine.replace_slice(table, SCHEMAS[table], written, slice_key, published, metadata)}


def commit_at_once(engine: DeltaRsEngine, commits: dict[str, Callable[[], dict]]) -> dict[str, dict]:
    """Each table's commit (a function of nothing), at once on an object store, where a commit is
    ~8 round trips of its own (`DeltaRsEngine.each`); what each returned, by table."""
    return dict(zip(commits, engine.each(lambda table: commits[table](), commits)))


def md_cell(text: str) -> str:
    """A markdown table cell of client text, as a code span: markdown's marks would render a
    client's link or remote image in the operator's UI (`[x](url)`, `![](url)`), and GFM makes a
    link of any bare `https://…` or `www.…` outside code; a `|` or a line break would end the
    cell or the row (a table's `\\|` holds in a code span too)."""
    text = text.replace("\r", " ").replace("\n", " ").replace("|", "\\|")
    if not text:
        return ""
    fence = "`" * (_backticks(text) + 1)
    pad = " " if text[0] == "`" or text[-1] == "`" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def fenced(text: str) -> str:
    """Markdown of `text` as is, in a code fence longer than any run of backticks it holds (which
    would close a fence of three and render what follows)."""
    fence = "`" * max(3, _backticks(text) + 1)
    return f"{fence}\n{text}\n{fence}"


def _backticks(text: str) -> int:
    """The longest run of backticks in `text`: a code span or fence of as many would end there."""
    return max((len(run) for run in re.findall(r"`+", text)), default=0)


def table_metadata(engine: DeltaRsEngine, table: str, summary: dict) -> dict:
    """`rows` as `entity-assets run` prints it; in the UI, the table's rows (from the Delta log),
    and a stream's rows of the slice (Dagster's partition row count)."""
    meta = {
        "rows": MetadataValue.int(summary["rows"]),
        # a replay's: the version its slice made, none once that commit left the log
        **({} if summary["version"] is None else {"delta_version": MetadataValue.int(summary["version"])}),
        "table_uri": MetadataValue.path(engine.uri(table)),
        # the latest version's: a publish commit after the slice's changes no rows, and a handle at
        # the slice's own version would read the log again
        "dagster/row_count": MetadataValue.int(engine.row_count(table)),
    }
    if table not in APPLIED_IN_ORDER:
        meta["dagster/partition_row_count"] = MetadataValue.int(summary["rows"])
    return meta


def with_columns(spec: AssetSpec) -> AssetSpec:
    """The asset's table's columns, for the UI's Columns tab."""
    schema = SCHEMAS[spec.key.to_user_string()]
    return spec.merge_attributes(metadata={"dagster/column_schema": TableSchema(columns=[
        TableColumn(f.name, str(f.type), constraints=TableColumnConstraints(nullable=f.nullable)) for f in schema])})


# --------------------------------------------------------------------------- redeliveries

SPLIT_BY = "request"
"""Every identity holds the request number: its low bits split the search among tasks."""
SPLIT_ROWS = 1_000_000
"""Rows of the slice one redelivery task holds at most (identity and coordinates only)."""


class Redeliveries(NamedTuple):
    rows_in: int  # the slice's rows of the input table
    at: frozenset  # the Kafka coordinates of its repeats, which the step leaves out
    reused: list[Repeat]  # those of them that are another request under an id used before


def redeliveries(spark, engine: DeltaRsEngine, table: str, slice_key: str, identity: tuple[str, ...],
                 window: int) -> Redeliveries:
    """The slice's rows of an input table, and its repeats.

    A row is a repeat when a row with the same `identity` came earlier in this slice (by
    Kafka coordinates) or in the `window` slices before it. Each of those slices must be
    ingested, so a slice refuses to go before them: one that failed at ingest while later ones
    went on would hide its deliveries from them. Only identity, coordinate and `begun` columns
    are read (`storage.repeated_deliveries`): by the driver for a small slice, else by tasks
    that split the identities among them, from which only the repeats come back. A repeat
    whose `begun` no earlier delivery had is no redelivery but a client's id used again for
    another request: it is left out all the same (its responses would take the first one's keys
    on the compacted response topics), and named by the step's `request_ids_not_reused` check.
    """
    seq = slice_seq(slice_key)
    for before in range(seq - 1, max(0, seq - max(window, 1) - 1), -1):
        if not engine.reached(table, key_of(before), "replace_slice"):
            raise OutOfOrder(f"slice {slice_key}: {table} holds no slice {key_of(before)}, so redeliveries cannot "
                             f"be found; slice {key_of(before)} is missing: materialize the slices in order")
    files = engine.slice_files(table, [slice_key])
    rows_in = sum(f.rows for f in files)
    if not rows_in:  # nothing to look for: no Spark job (most slices carry no schema patches)
        return Redeliveries(0, frozenset(), [])
    prior = engine.slice_files(table, [key_of(s) for s in range(max(1, seq - window), seq)])
    find = partial(repeated_deliveries, files, prior, identity, COORDINATES,
                   engine.storage_options, split_by=SPLIT_BY)
    if spark.on_driver(rows_in):
        found = find()
    else:
        parts = max(spark.parallelism(), -(-rows_in // SPLIT_ROWS))
        parts = 1 << (parts - 1).bit_length()  # a power of two
        found = on_executors(spark, list(range(parts)), lambda each: (x for p in each for x in find(part=p, parts=parts)))
    return Redeliveries(rows_in, frozenset(r.at for r in found), sorted(r for r in found if r.reused))


def reused_check_spec(asset: str, what: str, identity: tuple[str, ...]) -> AssetCheckSpec:
    return AssetCheckSpec("request_ids_not_reused", asset=asset,
                          description=f"no {what} repeats the {', '.join(identity)} of an earlier one (in the slice "
                                      "or its dedupe window) with another `begun`: a request under an id used "
                                      "before, left out as a redelivery; a warning names the first")


REUSED_SHOWN = 20
"""The reused request ids a check names: its count says how many there are."""


def reused_check(asset_key: str, identity: tuple[str, ...], found: Redeliveries) -> AssetCheckResult:
    """A warning: a client sent another request under an id it used before (the seed: "a unique
    request number specific to the client"), which is left out as a redelivery would be; its
    record stays in the input table, where the check's coordinates find it."""
    shown = [{**dict(zip(identity, r.identity)), "kafka": ":".join(map(str, r.at))} for r in found.reused[:REUSED_SHOWN]]
    return AssetCheckResult(asset_key=asset_key, check_name="request_ids_not_reused", passed=not found.reused,
                            severity=AssetCheckSeverity.WARN,
                            metadata={"reused": MetadataValue.int(len(found.reused)), "first": MetadataValue.json(shown)})


def counters(files: dict[str, list[DataFile]]) -> Counter:
    """The tasks' counters in their report, added up (see fold.COUNTER); a missing one is 0."""
    return Counter({t[len(COUNTER):]: sum(f.rows for f in fs) for t, fs in files.items() if t.startswith(COUNTER)})


def pop_counts(files: dict[str, list[DataFile]]) -> Counter:
    """`counters`, removed from the report."""
    counts = counters(files)
    for t in [t for t in files if t.startswith(COUNTER)]:
        del files[t]
    return counts


# --------------------------------------------------------------------------- state order

KINDS = frozenset({"spark", "delta", "kafka"})
"""The UI's kinds of a table that a topic feeds or carries."""
LAKE_KINDS = frozenset({"spark", "delta"})
"""The UI's kinds of a table no topic carries (a state, the learned schemas)."""

STATE_APP = "entity-assets"
"""App id of the Delta app transactions that record the last slice applied to a state table."""


class OutOfOrder(Failure):
    """A slice asked to go before its predecessor; the run fails with a message naming it."""

    def __init__(self, message: str):
        super().__init__(description=message)


def slice_of(context) -> str:
    """The run's slice key: a partition added by hand that is none (`5`) fails the step here,
    before it reads or writes a table under a key no slice has."""
    slice_seq(context.partition_key)
    return context.partition_key


def require_inputs(engine: DeltaRsEngine, slice_key: str, tables: Iterable[str], step: str) -> None:
    """Refuses a step of a slice whose input tables hold no commit of it (a subset of the graph
    materialized out of order, or a step whose commits one failure split). Applied to no rows,
    a state would record the slice as applied (`state_version`), and the slice's later runs
    would only replay it, so its changes would never reach the state; a stream would hold the
    slice empty, and hand that on to the steps after it."""
    if missing := [t for t in tables if not (engine.exists(t) and engine.reached(t, slice_key, "replace_slice"))]:
        names = ", ".join(missing)
        raise OutOfOrder(f"slice {slice_key}: {names} holds no rows of it yet, and {step} would write the slice "
                         f"without them: materialize {names} for slice {slice_key} first")


def state_version(engine: DeltaRsEngine, table: str, slice_key: str) -> tuple[bool, int | None]:
    """(apply, version): whether this slice advances `table`, and the state version to read.

    State advances strictly in slice order. A slice already applied is replayed against the
    state as of the slice before it (Delta time travel), and the state is left as it is.
    """
    seq = slice_seq(slice_key)
    applied = engine.applied(table, STATE_APP) or 0
    if applied < seq - 1:
        raise OutOfOrder(
            f"slice {slice_key} cannot be applied to {table}: it holds slices up to {key_of(applied)}, "
            f"so slice {key_of(applied + 1)} is missing. Materialize the slices in order (a backfill of "
            f"{key_of(applied + 1)}..{slice_key} does this)."
        )
    if applied == seq - 1:
        return True, None
    version = 0 if seq == 1 else engine.version_after(table, key_of(seq - 1), "apply")
    if version is None:
        raise OutOfOrder(f"slice {slice_key} cannot be replayed: no version of {table} in its Delta log records slice "
                         f"{key_of(seq - 1)}. lake_maintenance keeps versions (log and replaced files) for "
                         f"LakeResource.vacuum_retention_hours.")
    return False, version


def applied_version(engine: DeltaRsEngine, table: str, slice_key: str, step: str) -> int:
    """The version of state `table` as of the slice, which `step` reads; refused, saying why,
    when the slice is not applied yet or its version has left the log."""
    version = engine.version_after(table, slice_key, "apply")
    # an old version's commit may outlive its files: the log keeps what its checkpoint needs
    vacuumed = version is not None and version != engine.version(table) and engine.missing(
        table, engine.files(table, version))
    if version is not None and not vacuumed:
        return version
    if vacuumed or engine.reached(table, slice_key, "apply"):
        raise OutOfOrder(f"slice {slice_key} cannot be run again: {step} reads {table} as of the slice, a version "
                         f"that lake_maintenance has expired (it keeps LakeResource.vacuum_retention_hours): rebuild "
                         f"{table} and what it feeds from slice 1 (docs/operations.md, Upgrading)")
    raise OutOfOrder(f"slice {slice_key}: {table} has no state of it yet: materialize the step that applies it "
                     f"(apply_patches for entities and schemas) for slice {slice_key} first")


def commit_state(engine: DeltaRsEngine, table: str, slice_key: str, add, remove, metadata: dict | None = None) -> int:
    return engine.commit(table, SCHEMAS[table], add=add, remove=remove, operation="apply",
                         slice_key=slice_key, app_txn=(STATE_APP, slice_seq(slice_key)), metadata=metadata)


def state_as_of(engine: DeltaRsEngine, table: str, slice_key: str):
    """(apply, version, files): the state a slice folds over (see `state_version`).

    A replay reads an older version, whose files a vacuum may have deleted: it then fails saying so.
    """
    apply, version = state_version(engine, table, slice_key)
    files = engine.files(table, version, layout=SCHEMAS[table])  # a fold reads columns an older layout lacks
    if not apply and engine.missing(table, files):
        raise Failure(description=(
            f"slice {slice_key} cannot be replayed: the state of {table} it replays against (version {version}) "
            f"was vacuumed. lake_maintenance keeps replaced files for LakeResource.vacuum_retention_hours."))
    return apply, version, files


def state_snapshot(engine: DeltaRsEngine, table: str, slice_key: str):
    """(apply, snapshot, files by bucket) of a bucketed state table (see `state_as_of`)."""
    apply, _, snapshot = state_as_of(engine, table, slice_key)
    by_bucket: dict[int, list[TableFile]] = defaultdict(list)
    for f in snapshot:
        by_bucket[f.min["bucket"]].append(f)
    return apply, snapshot, dict(by_bucket)


def commit_buckets(engine: DeltaRsEngine, table: str, slice_key: str, apply: bool, snapshot,
                   files: dict[str, list[DataFile]], metadata: dict[str, str] | None = None) -> dict:
    """Replaces the state files the slice's tasks rewrote (popped from `files`), in one commit
    that records `metadata`; a replayed slice leaves the state as it is."""
    new_state, replaced = files.pop(table, []), {f.path for f in files.pop(REPLACED + table, [])}
    if apply:
        removed = [f for f in snapshot if f.uri in replaced]
        summary = {"rows": sum(f.rows for f in new_state), "files": len(new_state), "replaced_files": len(removed),
                   "version": commit_state(engine, table, slice_key, new_state, removed, metadata)}
    else:  # the version the slice made: a later one holds later slices' state
        summary = {"rows": 0, "files": 0, "replaced_files": 0,
                   "version": engine.version_after(table, slice_key, "apply")}
    summary["replayed"] = not apply
    return summary


def commit_buckets_later(engine: DeltaRsEngine, table: str, slice_key: str, apply: bool, snapshot,
                         files: dict[str, list[DataFile]], metadata: dict[str, str] | None = None) -> Callable[[], dict]:
    """`commit_buckets`, to make later (`commit_at_once`): the state's files leave `files` now."""
    state = {name: files.pop(name) for name in (table, REPLACED + table) if name in files}
    return partial(commit_buckets, engine, table, slice_key, apply, snapshot, state, metadata)


def one_row_per_key(engine: DeltaRsEngine, table: str, slice_key: str, counts: Counter, state: dict, *,
                    asset_key: str, check_name: str) -> AssetCheckResult:
    """Checks the state a slice made of a bucketed `table`: a key could repeat within a rewritten
    file (its task counts those) or across files of a bucket whose shards overlap (a rewrite
    must remove the files it replaces). `state`: the summary of the slice's state commit
    (`commit_buckets`), whose version is the one to check unless the slice was replayed."""
    version = engine.version_after(table, slice_key, "apply") if state["replayed"] else state["version"]
    shards_of: dict[int, list] = defaultdict(list)
    for f in engine.files(table, version):
        shards_of[f.min["bucket"]].append(shards.of_file(f.path))
    overlapping = sum(shards.overlapping(s) for s in shards_of.values())
    repeated = counts[f"check:repeated_keys:{table}"]
    return AssetCheckResult(asset_key=asset_key, check_name=check_name, passed=repeated == 0 and overlapping == 0,
                            metadata={"state_table": table, "repeated_keys_in_rewritten_files": repeated,
                                      "files_overlapping_another": overlapping})


def bucket_tasks(spark, rows: int) -> list[dict]:
    """Tasks owning whole state buckets ({"buckets"}): enough to use every core on a large slice,
    one for a small one (each task has a fixed cost)."""
    tasks = max(1, min(STATE_BUCKETS, task_slots(spark, rows) * 2, -(-rows // SMALL_TASK_ROWS)))
    return [{"buckets": list(range(i, STATE_BUCKETS, tasks))} for i in range(tasks)]


def run_buckets(spark, sources: dict[str, list], reader: Callable, body: Callable, *, key_columns: tuple[str, ...],
                order: tuple[str, ...], rows: int | None = None, **body_args) -> dict[str, list[DataFile]]:
    """Runs `body` over the rows of `sources` ({table: files}) by hash buckets of `key_columns`
    (see `fold.over_buckets`); `rows`: how many of the sources' rows the body gets, when fewer
    than they hold. No Spark job without rows."""
    rows = sum(f.rows for fs in sources.values() for f in fs) if rows is None else rows
    if not rows:
        return defaultdict(list)
    fn = partial(over_buckets, body=body, sources=sources,
                 reader=reader, key_columns=key_columns, order=order, **body_args)
    return run_tasks(spark, bucket_tasks(spark, rows), fn, rows)


def fold_buckets(spark, sources: dict[str, list[DataFile]], reader: Callable, task: Callable, **kwargs
                 ) -> tuple[dict[str, list[DataFile]], dict]:
    """Runs a bucketed state fold (see `fold_buckets_later`) and commits the state table."""
    files, commit = fold_buckets_later(spark, sources, reader, task, **kwargs)
    return files, commit()


def fold_buckets_later(spark, sources: dict[str, list[DataFile]], reader: Callable, task: Callable, *,
                       key_columns: tuple[str, ...], order: tuple[str, ...], engine: DeltaRsEngine, state_table: str,
                       slice_key: str, uris: dict[str, str], state_file_rows: int,
                       metadata: Callable[[Counter], dict[str, str]] | None = None,
                       **task_args) -> tuple[dict[str, list[DataFile]], Callable[[], dict]]:
    """Runs a bucketed state fold (see fold.BucketStore) over the rows of `sources`; the state
    table's commit is left to the caller, who may make it at once with others (`commit_at_once`).

    Each task reads the source files itself (`fold.over_buckets`, with `reader`) and keeps
    the rows of its buckets, sorted by `order` within a bucket. With no rows no Spark job
    runs, and the (empty) commit still records the slice in the state's order. Returns the
    other tables' files (the state's leave them at the commit) and the commit, which returns
    a summary of it: its `counts` are the tasks' counters, its `metadata` what it records, made from them.
    """
    apply, snapshot, state_files = state_snapshot(engine, state_table, slice_key)
    files = run_buckets(spark, sources, reader, task, key_columns=key_columns, order=order, slice_key=slice_key,
                        uris=uris, storage_options=engine.storage_options, state_files=state_files, write_state=apply,
                        state_file_rows=state_file_rows, **task_args)
    counts = pop_counts(files)
    recorded = metadata(counts) if metadata else None
    commit = commit_buckets_later(engine, state_table, slice_key, apply, snapshot, files, recorded)
    return files, lambda: {**commit(), "metadata": recorded, "counts": counts}


def merge_files(*groups: dict[str, list[DataFile]]) -> dict[str, list[DataFile]]:
    out: dict[str, list[DataFile]] = defaultdict(list)
    for group in groups:
        for table, files in group.items():
            out[table].extend(files)
    return out


# --------------------------------------------------------------------------- publishing

def publishing(kafka, engine: DeltaRsEngine, tables: Iterable[str]):
    """Where the tasks of a step publish those of `tables` that `kafka` publishes (None: none of
    them); creates missing topics and the step's outbox folder.

    Topics are created and their partitions and message limits looked up once per step, not
    once per table; the tasks then spool their messages as they write (see `publish_outbox`),
    all but those too large for their topic (`undeliverable_check`).
    """
    topics = {table: kafka.topic(STREAMS[table].name) for table in tables if kafka.publishes(STREAMS[table].name)}
    if not topics:
        return None
    config = kafka.config()
    ensure_topics(config, topics.values(), kafka.new_topic_partitions,
                  topic_configs={topic: kafka.new_topic_settings(STREAMS[table].name) for table, topic in topics.items()},
                  replication_factor=kafka.new_topic_replication_factor)
    partitions, limits = partition_counts(config, topics.values()), message_limits(config, topics.values())
    if lacking := sorted(set(topics.values()) - {t for t, n in partitions.items() if n}):
        # a broker that learns of a topic created a moment ago after the one ensure_topics asked
        raise KafkaUnreachable(f"Kafka lists no partitions of {', '.join(lacking)} yet; the step is retried")
    outbox = engine.uri(OUTBOX_FOLDER)
    if not is_remote(outbox):  # an object store has no folders to make: it would be three requests for nothing
        fs, path = filesystem(outbox, engine.storage_options)
        fs.create_dir(path, recursive=True)
    batch = int(producer_settings(config).get("batch.size", BATCH_BYTES))
    if limits and (smallest := max(1, min(limits.values()))) < batch:  # the broker holds a batch to its topic's limit
        config = {**config, "batch.size": smallest}
    return Publishing(config, {table: (topic, partitions[topic]) for table, topic in topics.items()}, outbox,
                      engine.storage_options, held_by=process(),
                      limits={table: limits.get(topic, producer_limit(config)) for table, topic in topics.items()})


BATCH_BYTES = 1_000_000
"""librdkafka's default `batch.size`, kept where every topic of a step takes batches that large."""
UNDELIVERED_SHOWN = 20
"""Messages too large that a check names: its metadata counts them all."""


def pop_undeliverable(files: dict[str, list[DataFile]]) -> list[dict]:
    """The messages too large for their topic that the tasks named (publish.UNDELIVERABLE),
    removed from the report."""
    return [json.loads(f.stats) for f in files.pop(UNDELIVERABLE, [])]


def undeliverable_check(asset_key: str, counts: Counter, examples: list[dict], publishing: bool) -> AssetCheckResult:
    """A warning, not a failure: a message over its topic's `max.message.bytes` would fail the step
    at every run of the slice, and hold back every slice after it. Its row is in the lake; raise
    the topic's limit and run the slice again to publish it (with REPUBLISH_TAG once later slices
    have published). A run that publishes nothing (Dagster wants a result all the same) says
    so: a bare pass would read as the slice's messages delivered."""
    by_stream = {STREAMS[name[len(UNDELIVERABLE):]].name: n for name, n in sorted(counts.items())
                 if name.startswith(UNDELIVERABLE) and n}
    return AssetCheckResult(asset_key=asset_key, check_name="messages_fit_their_topics", passed=not by_stream,
                            severity=AssetCheckSeverity.WARN, description=None if publishing else (
                                "this run published none of the step's streams (a later slice has published, or "
                                "the Kafka resource publishes none of them): it checked no message"),
                            metadata={"published": MetadataValue.bool(publishing),
                                      "undeliverable": MetadataValue.int(sum(by_stream.values())),
                                      "by_stream": MetadataValue.json(by_stream),
                                      "first": MetadataValue.json(examples[:UNDELIVERED_SHOWN])})


def delivery_check_spec(asset: str, streams: str) -> AssetCheckSpec:
    return AssetCheckSpec("messages_fit_their_topics", asset=asset,
                          description=f"every message of {streams} fits its topic's max.message.bytes; a warning "
                                      "counts and names those that did not, which stay in the lake only (run "
                                      "the slice again, tagged entity_assets/republish=true, once the limit is raised)")


PUBLISH = "publish"
"""The commit operation that records a slice's messages of a stream published (none, when the
stream is not published): the next slice publishes only after it (`require_published`)."""


def require_published(engine: DeltaRsEngine, table: str, slice_key: str) -> None:
    """Refuses slice N until `table`'s stream has published slice N-1 (a step commits before it
    publishes, so a slice whose publishing failed is applied: the next one, queued already, would
    put a key's later messages on Kafka first). A slice that an older release wrote, which
    records no publish, or that is older than the log's retention, is taken as published."""
    seq = slice_seq(slice_key)
    if seq == 1 or not engine.exists(table):
        return
    before = key_of(seq - 1)
    if engine.version_after(table, before, PUBLISH) is not None or _published_highest(engine, table) > before:
        return  # it published, or a later slice did (a re-run of older slices records no publish)
    written = engine.commit_after(table, before, "replace_slice")
    if written is None and engine.reached(table, before, "replace_slice"):
        return  # older than what the log holds
    if written is None and not any(done < before for done in engine.slices_done(table, "replace_slice")):
        made = engine.made_in(table)
        if made is None or made >= slice_key:
            return  # the table starts at this slice (new, or rebuilt from here): nothing before it to follow
        # a run of an earlier slice made it and failed before its commit
    elif written is not None and "publish_recorded" not in written:
        return  # an older release's
    raise OutOfOrder(f"slice {slice_key}: the {table} messages of slice {before} are not published (its run failed "
                     f"or has not run): run slice {before} first, so that a key's messages reach Kafka in order")


REPUBLISH_TAG = "entity_assets/republish"
"""A run tagged with it "true" publishes a slice older than one already published (see `publishes_slice`)."""


RECENT_COMMITS = 16
"""Commits of an operation read, newest first, for the highest slice it did (`highest_done`), where no
commit records it."""


def highest_done(engine: DeltaRsEngine, table: str, operation: str) -> str:
    """The highest slice among the newest commits of `operation` ("" if none): the highest slice
    done, as slices run in order, and a few re-runs of older slices come after it at most (an
    older release recorded a publish at each)."""
    return max(islice(engine.slices_done(table, operation), RECENT_COMMITS), default="")


def _published_highest(engine: DeltaRsEngine, table: str) -> str:
    """The highest slice `table`'s stream published ("" if none; a re-run of an older slice records
    no publish). The lake's note of it outlives the table: a table deleted and rebuilt from slice 1
    would otherwise publish its whole history again."""
    logged, noted = highest_done(engine, table, PUBLISH), engine.read_note(_published_note(table))
    if noted is None and logged:  # a lake of a release before the note: noted before the table may go
        engine.write_note(_published_note(table), logged)
    return max(logged, noted or "")


def _published_note(table: str) -> str:
    return f"published-{table}"


def publishes_slice(context, engine: DeltaRsEngine, table: str, slice_key: str) -> bool:
    """Whether this run of the slice publishes the streams of `table`'s step: not when its own
    messages or a later slice's are out already. The slice's messages carry older values of keys that
    later ones updated: consumers would take them as the latest, and so would compaction, which
    keeps a key's last message. Its rows are rewritten all the same."""
    later = _published_highest(engine, table)
    if later <= slice_key:  # the slice itself, when its publish is recorded (of a table rebuilt since too)
        if later < slice_key or context.run.tags.get(REPUBLISH_TAG) == "true":
            return True
        # a step retried after its publish (a read of the lake that failed), or the newest slice run again
        context.log.warning(f"slice {slice_key} publishes nothing: its {table} messages are published already "
                            f"(tag the run {REPUBLISH_TAG}=true, or `entity-assets run --slices {slice_key} "
                            "--republish`, to publish them again)")
        return False
    if context.run.tags.get(REPUBLISH_TAG) == "true" and PARENT_RUN_ID_TAG in context.run.tags:
        # the UI's re-execution keeps its parent's tags: slices published since would be overtaken unasked
        context.log.warning(f"slice {slice_key} publishes nothing: this run re-executes run "
                            f"{context.run.tags[PARENT_RUN_ID_TAG]} and keeps its {REPUBLISH_TAG} tag, given before "
                            f"later slices (up to {later}) may have published; launch a new run of the slice "
                            "with the tag to publish it anyway")
        return False
    if context.run.tags.get(REPUBLISH_TAG) == "true":
        context.log.warning(f"slice {slice_key} publishes again after slice {later} ({REPUBLISH_TAG}): "
                            "its messages overtake newer ones of their keys")
        return True
    context.log.warning(f"slice {slice_key} publishes nothing: slice {later} has published {table}'s stream, "
                        f"whose newer values of the same keys its messages would overtake (tag the run "
                        f"{REPUBLISH_TAG}=true, or `entity-assets run --slices {slice_key} --republish`, to publish them anyway)")
    return False


def record_published(engine: DeltaRsEngine, table: str, slice_key: str) -> None:
    """A `publish` commit, which the next slice asks for; none for a slice older than the newest
    published, whose own is there from its first run."""
    if _published_highest(engine, table) <= slice_key:
        engine.commit(table, SCHEMAS[table], add=[], operation=PUBLISH, slice_key=slice_key)
        engine.write_note(_published_note(table), slice_key)


def observe_topics(context, slice_key: str, publish_to, published: Counter) -> None:
    """The slice's messages on each topic the step published to (`publish_to`, None: none), on the
    topic's asset (`assets.topics`): the graph's last nodes, which a consumer reads."""
    for table in sorted(publish_to.topics if publish_to is not None else ()):
        context.log_event(AssetObservation(asset_key=topics.topic_key(STREAMS[table].name), partition=slice_key,
                                           metadata={"messages": MetadataValue.int(published[table])}))


OUTBOX_FOLDER = "_outbox"
"""The lake folder of the steps' outboxes: the messages their tasks spooled, until published."""


def publish_outbox(spark, files: dict[str, list[DataFile]], publish_to) -> Counter:
    """Publishes the messages the step's tasks spooled (their OUTBOX report rows, popped from
    `files`), once the caller has committed their rows; returns the count per table.

    Every spool goes out together, in one Spark job of at most one task per core (in the driver
    up to `SparkResource.driver_rows` messages): the broker takes the step's messages in one burst instead of
    one per task (see `kafka_io.Spool`). Spools that tasks run in the driver kept in memory
    (`Publishing.held`) go from here, before that job.
    The spools are deleted once their messages are acknowledged; a failure leaves them for
    lake_maintenance (those in memory go with the step), and a re-run of the slice publishes its
    messages again.
    """
    spools = files.pop(OUTBOX, [])
    if not spools or publish_to is None:
        return Counter()
    fn = partial(replay_task, kafka_config=publish_to.kafka_config, storage_options=publish_to.storage_options)
    counts: Counter = Counter()
    def spec(f: DataFile) -> dict:
        return {"uri": f.path, **json.loads(f.stats)}

    held = [spec(f) for f in spools if f.path in publish_to.held]
    spools = [f for f in spools if f.path not in publish_to.held]
    if held:  # spooled by tasks that ran in this process, which replays them from memory
        for row in fn(iter([{"spools": held}]), held=publish_to.held):
            counts[row["table"]] += row["count"]
    if not spools:
        return counts
    messages = sum(f.rows for f in spools)
    tasks: list[dict] = [{"spools": []} for _ in range(min(task_slots(spark, messages), len(spools)))]
    loads = [0] * len(tasks)
    for f in sorted(spools, key=lambda f: -f.rows):  # the largest first, each to the least loaded task
        i = loads.index(min(loads))
        tasks[i]["spools"].append(spec(f))
        loads[i] += f.rows
    for row in collect_tasks(spark, tasks, fn, messages):
        counts[row["table"]] += row["count"]
    return counts
