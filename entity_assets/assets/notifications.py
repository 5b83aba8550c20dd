"""Zones and devices: zone changes, per-device change summaries and notification counts."""

import gc
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    MaterializeResult,
    MetadataValue,
    asset,
)

from entity_assets import core, fold, notify
from entity_assets.assets.common import (
    KINDS,
    applied_version,
    commit_stream,
    delivery_check_spec,
    ensure_tables,
    fold_buckets,
    one_row_per_key,
    publishes_slice,
    publishing,
    require_inputs,
    require_published,
    slice_of,
    table_metadata,
    undeliverable_check,
    write_stream,
)
from entity_assets.assets.retries import retried_when_transient
from entity_assets.messages import ZoneSubscription
from entity_assets.notify import SUBSCRIPTIONS
from entity_assets.partitions import LAKE_POOL, slices_partitions
from entity_assets.patch import shown
from entity_assets.storage import read_row_groups, read_tables
from resources import KafkaResource, LakeResource, SlicingResource, SparkResource

TOP_ZONES = 100
"""zone_changes metadata lists the busiest zones only: a lake may have thousands."""


def _metadata(engine, table: str, summary: dict, **extra) -> dict:
    meta = table_metadata(engine, table, summary)
    meta["published"] = MetadataValue.int(summary["published"])
    meta.update(extra)
    return meta


@asset(partitions_def=slices_partitions, pool=LAKE_POOL, deps=["entity_updates"], group_name="notifications",
       kinds=KINDS,
       description="Entity updates by zone, its topic partitioned by zone; a change of a $zoneSubscription "
                   "entity goes to the partition of the zone it subscribes to (and of the one it left).",
       check_specs=[delivery_check_spec("zone_changes", "zone-changes")])
@retried_when_transient
def zone_changes(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource,
                 kafka: KafkaResource, slicing: SlicingResource) -> MaterializeResult:
    engine, key = lake.open(snapshot=True), slice_of(context)
    ensure_tables(engine, key, ["zone_changes"], reads=["entity_updates"])
    require_inputs(engine, key, ("entity_updates",), "zone_changes")
    summary, counts = write_stream(context, spark, kafka, slicing, engine, engine.slice_files("entity_updates", [key]),
                                    "zone_changes", key, fold.zone_changes_task)
    zones = sorted(((name.split(":", 1)[1], n) for name, n in counts.items() if name.startswith("subjectZone:")),
                   key=lambda zn: (-zn[1], zn[0]))
    shown_zones = Counter()  # a zone's name is as long as a client made it: long ones cut (and alike cut, added up)
    for zone, n in zones[:TOP_ZONES]:
        shown_zones[shown(zone)] += n
    # each task counts its busiest zones (fold.ZONES_COUNTED): past them, a zone's count and the
    # zone count are each task's counted ones, and `zones_uncounted` says how many it left out
    return MaterializeResult(metadata=_metadata(
        engine, "zone_changes", summary, zone_count=MetadataValue.int(len(zones)),
        zones_uncounted=MetadataValue.int(counts.get(fold.ZONES_UNCOUNTED, 0)),
        zones=MetadataValue.json(dict(shown_zones))),
        check_results=[undeliverable_check("zone_changes", counts, summary["undeliverable"], summary["publishing"])])


INVALID_SHOWN = 20
"""The invalid subscriptions a check names: the count says how many there are."""


def _subscriptions(state: pa.Table) -> tuple[list[tuple], list[tuple]]:
    """The $zoneSubscription entities in effect: (dbid, zone, entity, subscription) of those that
    describe one, sorted (dbid, zone, entity, why) of the others. Four columns read, not the rows
    whole: a lake may hold hundreds of thousands."""
    if not state.num_rows:
        return [], []
    live = state.filter(pc.invert(pc.fill_null(state["deleted"], False)))
    valid, invalid = [], []
    collecting = gc.isenabled()
    gc.disable()  # every object made here lives on: collections as they grow walk them again and again (2-3x)
    try:
        for dbid, zone, entity, document in zip(*(live[c].to_pylist() for c in ("dbid", "zone", "entity", "document"))):
            try:  # from the text in one pass; a bad one again, for read_subscription's words
                valid.append((dbid, zone, entity, ZoneSubscription.model_validate_json(document)))
            except ValueError:
                invalid.append((dbid, zone, entity, notify.read_subscription(core.loads(document))[1]))
    finally:
        if collecting:
            gc.enable()
    return valid, sorted(invalid)


def _zones(files, storage_options) -> set[tuple[str, str]]:
    """(dbid, zone) of a slice's zone changes: the only subscriptions its fan-out looks up. A file
    at a time: the driver holds the pairs, not a row per change."""
    zones = set()
    for read in read_tables(files, storage_options, columns=["dbid", "zone"]):
        pairs = read.group_by(["dbid", "zone"]).aggregate([])
        zones.update(zip(pairs["dbid"].to_pylist(), pairs["zone"].to_pylist()))
    return zones


@asset(partitions_def=slices_partitions, pool=LAKE_POOL, deps=["zone_changes", "entities"], group_name="notifications",
       kinds=KINDS,
       description="One change summary per subscribed device per change (created/updated/deleted), keyed by device. "
                   "device_notifications publishes them, each device's in the order their changes were applied "
                   "(an observation counts them).",
       check_specs=[AssetCheckSpec("subscriptions_are_valid", asset="changes_by_device",
                                   description="every $zoneSubscription entity describes a subscription")])
@retried_when_transient
def changes_by_device(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource,
                      kafka: KafkaResource, slicing: SlicingResource) -> MaterializeResult:
    """Subscriptions in effect are the $zoneSubscription entities as of the end of this slice.

    So a subscription created in a slice already receives every change of that slice, those
    before it too, and a subscription deleted or narrowed in a slice none of that slice's
    changes it no longer covers. A $zoneSubscription entity that describes no subscription (a
    field missing, an unknown action) is applied as any entity and notifies nobody: the check
    warns with its key and why.
    """
    engine, key = lake.open(snapshot=True), slice_of(context)
    ensure_tables(engine, key, ["changes_by_device"], reads=["zone_changes", "entities"])
    require_inputs(engine, key, ("zone_changes",), "changes_by_device")
    version = applied_version(engine, "entities", key, "changes_by_device")
    # state files hold a row group per collection: the others are skipped by their statistics
    subscriptions, invalid = _subscriptions(read_row_groups(engine.files("entities", version), "collection",
                                                            SUBSCRIPTIONS, engine.storage_options))
    changes = engine.slice_files("zone_changes", [key])
    # parsed and indexed here once, for the zones the slice changed: each task unpickles what it gets
    watched = _zones(changes, engine.storage_options)
    index = notify.SubscriptionIndex(s for s in subscriptions if (s[0], s[3].subjectZone) in watched)
    summary, _ = write_stream(context, spark, kafka, slicing, engine, changes, "changes_by_device", key,
                              fold.fan_out_task, published=False, columns=fold.FAN_OUT_COLUMNS, subscriptions=index)
    # names cut, as zone_changes' are: the check's metadata is written at every slice
    first = {f"{shown(dbid)}/{shown(zone)}/{shown(entity)}": shown(error, 300)
             for dbid, zone, entity, error in invalid[:INVALID_SHOWN]}
    meta = table_metadata(engine, "changes_by_device", summary)
    meta.update(subscriptions=MetadataValue.int(len(subscriptions)), invalid_subscriptions=MetadataValue.int(len(invalid)))
    return MaterializeResult(
        metadata=meta,
        check_results=[AssetCheckResult(check_name="subscriptions_are_valid", passed=not invalid,
                                        severity=AssetCheckSeverity.WARN,
                                        metadata={"invalid": len(invalid), "first": MetadataValue.json(first)})])


@asset(partitions_def=slices_partitions, pool=LAKE_POOL, deps=["changes_by_device", "notification_acks"],
       group_name="notifications",
       kinds=KINDS, description="Per device, the count of unacknowledged notifications with the first (begun) and "
                                "last (ended) notification time; one message per device whose inbox changed. "
                                "Its state, the device_inboxes table, holds each device's unacknowledged ones.",
       check_specs=[AssetCheckSpec("one_inbox_per_device", asset="device_notifications",
                                   description="the device_inboxes state holds no device twice"),
                    delivery_check_spec("device_notifications", "changes-by-device and device-notifications")])
@retried_when_transient
def device_notifications(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource,
                         kafka: KafkaResource) -> MaterializeResult:
    """Device inboxes are bucketed state; acks of a slice apply before its new notifications. Its
    tasks have each device's change summaries in order, so they publish changes-by-device too."""
    engine, key = lake.open(snapshot=True), slice_of(context)
    ensure_tables(engine, key, ["device_notifications", "device_inboxes"],
                  reads=["changes_by_device", "notification_acks"])
    note_files, ack_files = engine.slice_files("changes_by_device", [key]), engine.slice_files("notification_acks", [key])
    uris = {t: engine.uri(t) for t in ("device_notifications", "device_inboxes")}
    require_inputs(engine, key, ("changes_by_device", "notification_acks"), "device_notifications")
    require_published(engine, "device_notifications", key)
    publish_to = (publishing(kafka, engine, ["changes_by_device", "device_notifications"])
                  if publishes_slice(context, engine, "device_notifications", key) else None)
    files, inboxes = fold_buckets(spark, {"changes_by_device": note_files, "notification_acks": ack_files},
                                  fold.inbox_events, fold.inbox_task, key_columns=("device",),
                                  order=fold.INBOX_ORDER, engine=engine,
                                  state_table="device_inboxes", slice_key=key, uris=uris,
                                  state_file_rows=lake.state_file_rows,
                                  publishing=publish_to)
    summary, counts = commit_stream(context, spark, engine, "device_notifications", files, key, publish_to,
                                    inboxes["counts"])
    return MaterializeResult(metadata=_metadata(
        engine, "device_notifications", summary, inbox_version=MetadataValue.int(inboxes["version"]),
        acks=MetadataValue.int(sum(f.rows for f in ack_files)),
        expired_notifications=MetadataValue.int(inboxes["counts"].get(fold.EXPIRED_NOTIFICATIONS, 0)),
        unmatched_ack_ids=MetadataValue.int(inboxes["counts"].get(fold.UNMATCHED, 0)),
        replayed=MetadataValue.bool(inboxes["replayed"])), check_results=[one_row_per_key(
            engine, "device_inboxes", key, counts, inboxes, asset_key="device_notifications",
            check_name="one_inbox_per_device"),
            undeliverable_check("device_notifications", counts, summary["undeliverable"], summary["publishing"])])
