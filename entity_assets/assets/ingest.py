"""Input streams: Kafka records of a slice become the raw tables and dead letters."""


from collections import Counter
from functools import partial

from dagster import (AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, AssetExecutionContext, AssetSpec, Failure,
                     MaterializeResult, MetadataValue, multi_asset)

from entity_assets.assets.common import commit_slice, ensure_tables, run_tasks, table_metadata
from entity_assets.ingest import INPUT_STREAMS, ingest_tasks
from entity_assets.kafka_io import warm_producer
from entity_assets.manifests import ManifestStore
from entity_assets.partitions import LAKE_POOL, slices_partitions
from entity_assets.slices import split_ranges
from resources import KafkaResource, LakeResource, SlicingResource, SparkResource

DESCRIPTIONS = {
    "entity_batches": "Batch requests from the entity-batches topic, validated; the durable log every derived stream is rebuilt from.",
    "schema_patches": "Schema patch requests from the schema-patches topic, validated.",
    "connections": "Driver connections (user, device, app version) from the connections topic, validated.",
    "notification_acks": "Acknowledgements of device notifications from the notification-acks topic, validated.",
    "dead_letters": "Every record that could not be parsed or validated, with its bytes, Kafka coordinates, code and reason.",
}
GROUPS = {"entity_batches": "entities", "schema_patches": "schemas", "connections": "devices",
          "notification_acks": "devices", "dead_letters": "quality"}
TABLES = tuple(s.table for s in INPUT_STREAMS.values()) + ("dead_letters",)


@multi_asset(
    name="ingest",
    specs=[
        AssetSpec(t, description=DESCRIPTIONS[t], group_name=GROUPS[t], kinds={"spark", "delta", "kafka"})
        for t in TABLES
    ],
    check_specs=[AssetCheckSpec("no_dead_letters", asset="dead_letters",
                                description="every record of the slice parsed and validated; a warning counts "
                                            "the others by stream and code (their bytes and reasons are rows of the table)")],
    partitions_def=slices_partitions, pool=LAKE_POOL,
    can_subset=False,
)
def ingest(context: AssetExecutionContext, spark: SparkResource, kafka: KafkaResource,
           lake: LakeResource, slicing: SlicingResource):
    """Reads exactly the manifest's offset ranges, so any re-run re-reads the same records."""
    engine = lake.open(snapshot=True)
    if kafka.publish:  # the later steps publish from this process: their producer starts now
        warm_producer(kafka.config())
    manifest = ManifestStore(engine).get(context.partition_key)
    ensure_tables(engine, TABLES)
    streams_by_topic = {r.topic: kafka.input_stream(r.topic) for r in manifest.ranges if r.count > 0}
    if unread := sorted(t for t, s in streams_by_topic.items() if s is None):
        raise Failure(f"slice {manifest.key} holds records of {', '.join(unread)}, which no input stream reads "
                      "(the seed's topics under the topic prefix, and the ingestion topics of the configured "
                      "sources): restore the Kafka resource's settings that closed the slice")
    ranges = [r for r in manifest.ranges if r.count > 0]
    tasks = [vars(r) for r in split_ranges(ranges, slicing.max_messages_per_task)]
    fn = partial(
        ingest_tasks, kafka_config=kafka.config(), streams_by_topic=streams_by_topic,
        slice_key=manifest.key, table_uris={t: engine.uri(t) for t in TABLES},
        storage_options=engine.storage_options,
    )
    summary = commit_slice(engine, TABLES, run_tasks(spark, tasks, fn, manifest.messages), manifest.key)
    context.log.info(f"slice {manifest.key}: {manifest.messages} records in {len(tasks)} tasks -> "
                     + ", ".join(f"{t}={s['rows']}" for t, s in summary.items()))
    offsets: dict[str, dict[str, str]] = {}
    for r in ranges:
        table = streams_by_topic[r.topic].table
        offsets.setdefault(table, {})[f"{r.topic}[{r.partition}]"] = f"[{r.start}, {r.end})"
    for table in TABLES:
        meta = table_metadata(engine, table, summary[table])
        if table != "dead_letters":
            meta["dead_letters"] = MetadataValue.int(summary["dead_letters"]["rows"])
            meta["offsets"] = MetadataValue.json(offsets.get(table, {}))
        meta["slice_messages"] = MetadataValue.int(manifest.messages)
        yield MaterializeResult(asset_key=table, metadata=meta)
    yield _dead_letters_check(engine, manifest.key, summary["dead_letters"]["rows"])


def _dead_letters_check(engine, slice_key: str, dead: int) -> AssetCheckResult:
    """A warning, not a failure: bad input is expected of producers, and the slice's good records went on."""
    by_code: Counter = Counter()
    if dead:
        rows = engine.read("dead_letters", columns=["slice", "stream", "code"], where={"slice": slice_key})
        by_code.update(f"{r['stream']} {r['code']}" for r in rows.to_pylist())  # `where` kept the slice's rows only
    return AssetCheckResult(asset_key="dead_letters", check_name="no_dead_letters", passed=not dead,
                            severity=AssetCheckSeverity.WARN,
                            metadata={"dead_letters": MetadataValue.int(dead),
                                      "by_stream_and_code": MetadataValue.json(dict(sorted(by_code.items())))})
