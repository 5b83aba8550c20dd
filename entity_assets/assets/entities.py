"""The entity core: patches, updates, entity state, partial and complete responses."""

from functools import partial

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetSpec,
    MaterializeResult,
    MetadataValue,
    asset,
    multi_asset,
)

from entity_assets import fold
from entity_assets.assets.common import (
    KINDS,
    LAKE_KINDS,
    STATE_APP,
    bucket_tasks,
    commit_at_once,
    commit_buckets_later,
    commit_state,
    delivery_check_spec,
    ensure_tables,
    fold_buckets_later,
    md_cell,
    merge_files,
    observe_topics,
    one_row_per_key,
    pop_counts,
    pop_undeliverable,
    publish_outbox,
    publishes_slice,
    publishing,
    record_published,
    redeliveries,
    replace_slice,
    reused_check,
    reused_check_spec,
    require_inputs,
    require_published,
    run_buckets,
    run_tasks,
    slice_of,
    state_as_of,
    state_snapshot,
    table_metadata,
    undeliverable_check,
    write_stream,
)
from entity_assets.assets.retries import retried_when_transient
from entity_assets.core import BATCH_IDENTITY, ORDER, REQUEST_ORDER, SCHEMA_PATCH_IDENTITY
from entity_assets.patch import STATUS_FAILED, STATUS_NOT_FOUND, STATUS_OK
from entity_assets.partitions import LAKE_POOL, slices_partitions
from entity_assets.slices import slice_seq
from entity_assets.storage import read_batches
from resources import KafkaResource, LakeResource, SlicingResource, SparkResource

CORE_GROUP = "entity_core"
"""A group per step: a step writes its tables together (`can_subset=False`), so the UI's
Materialize of a group must select all of them."""


WINDOW = "dedupe_window"
"""Commit info of entity_patches: the dedupe window its slice used, which the slice's re-runs
use too (the state holds what that window applied)."""


def dedupe_window(context, engine, slice_key: str, slicing: SlicingResource, *, patched: bool = False) -> int:
    """The slicing resource's `dedupe_window_slices`, or, for a slice the state has applied, the
    window its run used: with another, a re-run would drop other redeliveries than the state applied.
    `patched`: the window entity_patches took for the slice, which its schema patches take too
    (the setting may have changed between the two steps: a run re-executed from its failure)."""
    if not patched and (not engine.exists("entities")
                        or (engine.applied("entities", STATE_APP) or 0) < slice_seq(slice_key)):
        return slicing.dedupe_window_slices
    entry = engine.commit_after("entity_patches", slice_key, "replace_slice") or {}
    window = int(entry.get(WINDOW, slicing.dedupe_window_slices))
    if window != slicing.dedupe_window_slices:
        context.log.info(f"slice {slice_key} keeps the dedupe window of its first run, {window} slices "
                         f"(dedupe_window_slices is {slicing.dedupe_window_slices} now)")
    return window


@asset(
    partitions_def=slices_partitions, pool=LAKE_POOL,
    deps=["entity_batches"],
    group_name=CORE_GROUP,
    kinds=KINDS,
    description="One patch per entity of each batch (part is 1-based in batch order); its topic keyed and partitioned by "
                "entity id. apply_patches publishes them, in the order it applies them (an observation counts them).",
    check_specs=[reused_check_spec("entity_patches", "entity batch", BATCH_IDENTITY)],
)
@retried_when_transient
def entity_patches(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource,
                   kafka: KafkaResource, slicing: SlicingResource) -> MaterializeResult:
    """Redelivered requests (same clientid and request) are exploded once.

    A request seen earlier in this slice (lower Kafka coordinates) or in the previous
    `dedupe_window_slices` slices is a duplicate: it stays in entity_batches, the durable
    log, and is counted here (a request id used again, named by a check). Spark finds
    duplicates on the identity columns alone; the tasks then read the batch files, explode,
    write and publish in one pass.
    """
    engine, key = lake.open(snapshot=True), slice_of(context)
    ensure_tables(engine, key, ["entity_patches"], reads=["entity_batches"])
    require_inputs(engine, key, ("entity_batches",), "entity_patches")
    window = dedupe_window(context, engine, key, slicing)
    found = redeliveries(spark, engine, "entity_batches", key, BATCH_IDENTITY, window)
    summary, counts = write_stream(context, spark, kafka, slicing, engine, engine.slice_files("entity_batches", [key]),
                                   "entity_patches", key, fold.explode_task, published=False,
                                   metadata={WINDOW: str(window)}, redelivered=found.at)
    meta = table_metadata(engine, "entity_patches", summary)
    meta.update(batches=found.rows_in, duplicates=counts["redelivered"], reused_request_ids=len(found.reused))
    return MaterializeResult(metadata=meta, check_results=[reused_check("entity_patches", BATCH_IDENTITY, found)])


RESPONSE_STATUSES = {"entity-updates": (STATUS_OK, STATUS_NOT_FOUND, STATUS_FAILED),
                     "schema-updates": (STATUS_OK, STATUS_FAILED)}
"""The statuses of the partial responses of each stream (a schema always exists: no status 2)."""

STREAM_TABLES = ("entity_updates", "schema_updates", "partial_responses", "schema_learning")
STATE_TABLES = ("entities", "schemas", "pending_responses")
PUBLISHED = ("entity_patches", "entity_updates", "schema_updates", "schema_learning", "partial_responses",
             "complete_responses")
"""The streams apply_patches publishes: entity-patches too, each entity's in the order the fold applies them."""
APPLY_TABLES = STREAM_TABLES + STATE_TABLES + ("complete_responses",)


@multi_asset(
    name="apply_patches",
    specs=[
        AssetSpec("entity_updates", deps=["entity_patches"], group_name=CORE_GROUP, kinds=KINDS,
                  description="Successful entity patches only (status 1), with ended and before/after as requested."),
        AssetSpec("entities", deps=["entity_patches"], group_name=CORE_GROUP, kinds=LAKE_KINDS,
                  description="State: current document and version per (dbid, collection, zone, entity); "
                              "Delta versions give the state as of any slice of the last "
                              "vacuum_retention_hours (7 days)."),
        AssetSpec("schema_updates", deps=["schema_patches"], group_name=CORE_GROUP, kinds=KINDS,
                  description="Every schema patch processed: status 1, or 3 with its error; before/after as "
                              "requested (the seed: a durable record of all schema patch requests)."),
        AssetSpec("schemas", deps=["schema_patches"], group_name=CORE_GROUP, kinds=LAKE_KINDS,
                  description="State: the declared schema document and version of each database."),
        AssetSpec("schema_learning", deps=["entity_patches", "schema_patches"], group_name=CORE_GROUP, kinds=KINDS,
                  description="Entity updates of learning requests plus one entity-type message per type of "
                              "every updated schema; its topic partitioned by collection."),
        AssetSpec("partial_responses", deps=["entity_patches", "schema_patches"], group_name=CORE_GROUP, kinds=KINDS,
                  description="One response per processed part of entity and schema requests, any status; "
                              "its topic keyed by request id, partitioned by client id."),
        AssetSpec("complete_responses", deps=["partial_responses"], group_name=CORE_GROUP, kinds=KINDS,
                  description="One message per request once every part is processed, responses ordered by part; parts "
                              "of requests not yet complete wait in the pending_responses state table, for "
                              "parts_wait_slices slices at most."),
    ],
    check_specs=[
        AssetCheckSpec("updates_are_successes", asset="entity_updates",
                       description="entity-updates holds only status 1"),
        AssetCheckSpec("responses_have_every_part", asset="complete_responses",
                       description="every complete response carries `parts` responses"),
        AssetCheckSpec("no_request_expired", asset="complete_responses",
                       description="no request stayed incomplete for the slicing resource's parts_wait_slices"),
        AssetCheckSpec("one_row_per_entity", asset="entities", description="no entity key appears twice"),
        AssetCheckSpec("one_row_per_database", asset="schemas", description="no database appears twice"),
        delivery_check_spec("entity_updates", "the streams apply_patches publishes"),
        reused_check_spec("schema_updates", "schema patch", SCHEMA_PATCH_IDENTITY),
    ],
    partitions_def=slices_partitions, pool=LAKE_POOL,
    can_subset=False,
)
@retried_when_transient
def apply_patches(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource, kafka: KafkaResource,
                  slicing: SlicingResource):
    """Folds the slice's entity and schema patches over their state, bucket by bucket, in slice order.

    Entity and schema results share one step because both feed partial and complete
    responses and schema learning.
    """
    engine, key = lake.open(snapshot=True), slice_of(context)
    ensure_tables(engine, key, APPLY_TABLES, reads=["entity_patches", "schema_patches"])
    uris = {t: engine.uri(t) for t in APPLY_TABLES}
    require_inputs(engine, key, ("entity_patches", "schema_patches"), "apply_patches")
    require_published(engine, "entity_updates", key)
    publish_to = publishing(kafka, engine, PUBLISHED) if publishes_slice(context, engine, "entity_updates", key) else None

    # entities: each task folds whole buckets, reading their row groups of the slice's patches
    apply, snapshot, state_files = state_snapshot(engine, "entities", key)
    patch_files = engine.slice_files("entity_patches", [key])
    fn = partial(fold.fold_task, slice_key=key, uris=uris, storage_options=engine.storage_options,
                 patch_files=patch_files, state_files=state_files, write_state=apply,
                 state_file_rows=lake.state_file_rows, publishing=publish_to)
    rows = sum(f.rows for f in patch_files)
    entity_files = run_tasks(spark, bucket_tasks(spark, rows), fn, rows)
    commit_entities = commit_buckets_later(engine, "entities", key, apply, snapshot, entity_files)

    schema_found = redeliveries(spark, engine, "schema_patches", key, SCHEMA_PATCH_IDENTITY,
                                dedupe_window(context, engine, key, slicing, patched=True))
    schema_files, commit_schemas = fold_buckets_later(
        spark, {"schema_patches": engine.slice_files("schema_patches", [key])},
        partial(fold.schema_patch_rows, redelivered=schema_found.at), fold.schema_fold_task, key_columns=("dbid",),
        order=("dbid",) + ORDER, engine=engine, state_table="schemas", slice_key=key, uris=uris,
        state_file_rows=lake.state_file_rows, publishing=publish_to)
    pending_apply, _, pending = state_as_of(engine, "pending_responses", key)
    if not apply:
        context.log.info(f"slice {key} is already applied: replayed against the state of the slice before it")

    # both states and the stream tables in one round of commits (at once on an object store): a
    # commit that a failure leaves out is made by the slice's re-run, which replays what is applied
    files = merge_files(entity_files, schema_files)
    summary = commit_at_once(engine, {"entities": commit_entities, "schemas": commit_schemas,
                                      **{t: partial(replace_slice, engine, t, files, key) for t in STREAM_TABLES}})
    entities, schemas = summary["entities"], summary["schemas"]

    # requests of several parts: this slice's parts plus the parts still pending from earlier slices
    # (no Spark job when there are neither, as in a slice of single-part requests)
    counts = pop_counts(files) + schemas["counts"]
    if counts["multipart"] or pending:
        # tasks own hash buckets of (clientid, request): every part of a request meets in one task
        sources = {"partial_responses": engine.slice_files("partial_responses", [key]), "pending_responses": pending}
        completed = run_buckets(spark, sources, fold.multipart_parts, fold.complete_task,
                                key_columns=("clientid", "request"), order=REQUEST_ORDER,
                                rows=counts["multipart"] + sum(f.rows for f in pending), slice_key=key, uris=uris,
                                storage_options=engine.storage_options, write_state=pending_apply,
                                wait_slices=slicing.parts_wait_slices, publishing=publish_to)
        counts += pop_counts(completed)
        files = merge_files(files, completed)
    new_pending = files.pop("pending_responses", [])
    last = {"complete_responses": partial(replace_slice, engine, "complete_responses", files, key)}
    if pending_apply:
        last["pending_responses"] = partial(commit_state, engine, "pending_responses", key, new_pending, pending)
    summary["complete_responses"] = commit_at_once(engine, last)["complete_responses"]
    undeliverable = pop_undeliverable(files)
    published = publish_outbox(spark, files, publish_to)
    record_published(engine, "entity_updates", key)  # the step's streams go out together
    observe_topics(context, key, publish_to, published)

    by_status = {tuple(name.split(":")[1:]): n for name, n in counts.items() if name.startswith("status:")}

    for table in ("entity_updates", "entities", "schema_updates", "schemas", "schema_learning",
                  "partial_responses", "complete_responses"):
        meta = table_metadata(engine, table, summary[table])
        if table in PUBLISHED:
            meta["published"] = MetadataValue.int(published[table])
        if table == "partial_responses":  # every key at every slice, 0 too: the UI plots each with no gaps
            meta.update({f"{stream} status {status}": MetadataValue.int(by_status.get((stream, str(status)), 0))
                         for stream, statuses in RESPONSE_STATUSES.items() for status in statuses})
            meta["pending_parts"] = MetadataValue.int(sum(f.rows for f in new_pending) if pending_apply else 0)
        if table == "entity_updates":
            meta["preview"] = MetadataValue.md(_preview(engine, key))
        if table in ("entities", "schemas"):
            meta["replayed"] = MetadataValue.bool(summary[table]["replayed"])
            meta["replaced_files"] = MetadataValue.int(summary[table]["replaced_files"])
        if table == "schema_updates":
            processed = sum(n for (stream, _), n in by_status.items() if stream == "schema-updates")
            meta["duplicates"] = MetadataValue.int(schema_found.rows_in - processed)
            meta["reused_request_ids"] = MetadataValue.int(len(schema_found.reused))
        yield MaterializeResult(asset_key=table, metadata=meta)
    statuses = engine.column_bounds("entity_updates", key, "status")  # schema-updates holds failures too (fold.SUCCESSES_ONLY)
    yield AssetCheckResult(asset_key="entity_updates", check_name="updates_are_successes", passed=statuses in (None, (1, 1)),
                           metadata={"status_min_max": str(statuses), "checked": "parquet statistics of every file"})
    yield AssetCheckResult(asset_key="complete_responses", check_name="responses_have_every_part",
                           passed=counts["check:incomplete"] == 0, metadata={"incomplete": counts["check:incomplete"]})
    expired = sorted(name[len(fold.EXPIRED_REQUEST):] for name in counts
                     if name.startswith(fold.EXPIRED_REQUEST) and name != fold.EXPIRED_REQUEST)
    yield AssetCheckResult(asset_key="complete_responses", check_name="no_request_expired",
                           passed=not counts[fold.EXPIRED_REQUEST], severity=AssetCheckSeverity.WARN,
                           metadata={"expired": counts[fold.EXPIRED_REQUEST],
                                     "first": MetadataValue.json(expired[:fold.SHOWN_EXPIRED])})
    yield one_row_per_key(engine, "entities", key, counts, entities, asset_key="entities",
                          check_name="one_row_per_entity")
    yield one_row_per_key(engine, "schemas", key, counts, schemas, asset_key="schemas",
                          check_name="one_row_per_database")
    yield reused_check("schema_updates", SCHEMA_PATCH_IDENTITY, schema_found)
    yield undeliverable_check("entity_updates", counts, undeliverable, publish_to is not None)


def _preview(engine, key: str, n: int = 5) -> str:
    """The ops too: `after` is there only where the request asked for it (CDC sources by default do not)."""
    cols = ["entity", "collection", "zone", "part", "action", "ops", "after"]
    files = sorted(engine.slice_files("entity_updates", [key]), key=lambda f: f.rows)
    rows = next(read_batches(files[0], engine.storage_options, batch_size=n, columns=cols)).to_pylist() if files else []
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("–" if r[c] is None else md_cell(str(r[c])[:60]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
