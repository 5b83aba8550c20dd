"""Zones and devices: zone changes, per-device change summaries and notification counts."""

from functools import partial

from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue, asset

from entity_assets import fold
from entity_assets.assets.common import (
    collect_files,
    commit_slice,
    ensure_tables,
    fold_buckets,
    pop_counts,
    publishing,
    read_df,
    table_metadata,
)
from entity_assets.core import STATE_BUCKETS
from entity_assets.notify import SUBSCRIPTIONS
from entity_assets.partitions import slices_partitions
from resources import KafkaResource, LakeResource, SparkResource

KINDS = {"spark", "delta", "kafka"}


def _write_stream(kafka, engine, df, table: str, key: str, task, **task_args) -> dict:
    """Runs `task` over `df`: it writes and publishes `table`."""
    fn = partial(task, slice_key=key, uris={table: engine.uri(table)}, storage_options=engine.storage_options,
                 publishing=publishing(kafka, [table]), **task_args)
    files = collect_files(df.mapInArrow(fn, fold.FILES_DDL))
    counts = pop_counts(files)
    summary = commit_slice(engine, [table], files, key)[table]
    summary["published"] = counts[f"published:{table}"]
    return summary


def _metadata(engine, table: str, summary: dict, **extra) -> dict:
    meta = table_metadata(engine, table, summary)
    meta["published"] = MetadataValue.int(summary["published"])
    meta.update(extra)
    return meta


@asset(partitions_def=slices_partitions, deps=["entity_updates"], group_name="notifications", kinds=KINDS,
       description="Entity updates by zone; changes of $zoneSubscription entities are partitioned by the zone "
                   "they subscribe to.")
def zone_changes(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource,
                 kafka: KafkaResource) -> MaterializeResult:
    engine, key = lake.open(), context.partition_key
    ensure_tables(engine, ["zone_changes"])
    updates = read_df(spark.session(), engine.slice_files("entity_updates", [key]), "entity_updates")
    summary = _write_stream(kafka, engine, updates, "zone_changes", key, fold.copy_task, target="zone_changes")
    zones = {r["subjectZone"]: r["count"] for r in updates.groupBy("subjectZone").count().collect()}
    return MaterializeResult(metadata=_metadata(engine, "zone_changes", summary, zones=MetadataValue.json(zones)))


@asset(partitions_def=slices_partitions, deps=["zone_changes", "entities"], group_name="notifications", kinds=KINDS,
       description="One change summary per subscribed device per change (created/updated/deleted), keyed by device.")
def changes_by_device(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource,
                      kafka: KafkaResource) -> MaterializeResult:
    """Subscriptions in effect are the $zoneSubscription entities as of the end of this slice.

    So a subscription created in a slice already receives the changes of that slice that
    follow it in the entity state, and every change of later slices.
    """
    engine, key = lake.open(), context.partition_key
    ensure_tables(engine, ["changes_by_device"])
    session = spark.session()
    version = engine.version_after("entities", key, "apply")
    if version is None:
        raise Failure(f"entities has no state for slice {key}: materialize apply_patches for it first")
    subscriptions = [
        (r["dbid"], r["entity"], r["document"])
        for r in read_df(session, engine.files("entities", version), "entities")
        .filter((f"collection = '{SUBSCRIPTIONS}'")).filter("NOT deleted").select("dbid", "entity", "document").collect()
    ]
    changes = read_df(session, engine.slice_files("zone_changes", [key]), "zone_changes").filter(
        f"collection != '{SUBSCRIPTIONS}'")
    summary = _write_stream(kafka, engine, changes, "changes_by_device", key, fold.fan_out_task,
                            subscriptions=subscriptions)
    return MaterializeResult(metadata=_metadata(engine, "changes_by_device", summary,
                                                subscriptions=MetadataValue.int(len(subscriptions))))


@asset(partitions_def=slices_partitions, deps=["changes_by_device", "notification_acks"], group_name="notifications",
       kinds=KINDS, description="Per device, the count of unacknowledged notifications with the first (begun) and "
                                "last (ended) notification time; one message per device whose count changed.")
def device_notifications(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource,
                         kafka: KafkaResource) -> MaterializeResult:
    """Device inboxes are bucketed state; acks of a slice apply after its new notifications."""
    from pyspark.sql import functions as F

    engine, key = lake.open(), context.partition_key
    ensure_tables(engine, ["device_notifications", "device_inboxes"])
    session = spark.session()
    columns = ("dbid", "user", "device", "kind", "notification", "ended", "notifications", "upTo")
    notes = read_df(session, engine.slice_files("changes_by_device", [key]), "changes_by_device").select(
        "dbid", "user", "device", F.lit("a-notify").alias("kind"), "notification", "ended",
        F.lit(None).cast("string").alias("notifications"), F.lit(None).cast("long").alias("upTo"))
    acks = read_df(session, engine.slice_files("notification_acks", [key]), "notification_acks").select(
        "dbid", "user", "device", F.lit("b-ack").alias("kind"), F.lit(None).cast("string").alias("notification"),
        F.col("begun").alias("ended"), "notifications", "upTo")
    events = notes.unionByName(acks).select(*columns).withColumn(
        "bucket", (F.crc32(F.col("device")) % STATE_BUCKETS).cast("int"))
    uris = {t: engine.uri(t) for t in ("device_notifications", "device_inboxes")}
    files, inboxes = fold_buckets(spark, events, ("device", "kind", "ended", "notification"), fold.inbox_task,
                                  engine=engine, state_table="device_inboxes", slice_key=key, uris=uris,
                                  publishing=publishing(kafka, ["device_notifications"]))
    counts = pop_counts(files)
    summary = commit_slice(engine, ["device_notifications"], files, key)["device_notifications"]
    summary["published"] = counts["published:device_notifications"]
    return MaterializeResult(metadata=_metadata(
        engine, "device_notifications", summary, inbox_version=MetadataValue.int(inboxes["version"]),
        acks=MetadataValue.int(sum(f.rows for f in engine.slice_files("notification_acks", [key]))),
        replayed=MetadataValue.bool(inboxes["replayed"])))
