"""The Kafka topics at both ends of the graph, as external assets: the lineage the UI draws then
runs from the topic a client produced a batch to, through the tables, to the topic a device's
notification count is published on.

No step materializes them (clients produce the input topics; a table's step publishes its
stream's topic, and observes it: the slice's messages), so they are external assets: nodes of
the graph, in no job. A deployment's topic prefix comes first in
each name (`KafkaResource.topic_prefix`); the keys stay the seed's stream names.
"""

from dagster import AssetKey, AssetSpec

from entity_assets.ingest import INPUT_STREAMS, IngestionStream
from entity_assets.partitions import slices_partitions
from entity_assets.publish import STREAMS

GROUP = "kafka"


def topic_key(stream: str) -> AssetKey:
    """The asset of the seed stream's topic: `kafka/entity-batches`."""
    return AssetKey([GROUP, stream])


def _spec(stream: str, description: str, deps: tuple[str, ...] = (), partitions_def=None) -> AssetSpec:
    return AssetSpec(topic_key(stream), deps=deps, description=description, group_name=GROUP, kinds={"kafka"},
                     partitions_def=partitions_def)


INGESTION = IngestionStream.name
INPUT_TOPICS = [
    *(_spec(s.name, f"Input topic `{s.name}`, produced by clients; ingest reads each slice's offsets of it into "
                    f"{s.table}, its bad records into dead_letters.") for s in INPUT_STREAMS.values()),
    _spec(INGESTION, "Change data capture topics `<system>.<projection>.ingestion` (Debezium, GoldenGate, DB2, Qlik "
                     "Replicate), read by pattern; their changes become entity_batches rows."),
]
OUTPUT_TOPICS = [_spec(stream.name, f"Output topic `{stream.name}`: the {table} rows of each slice, keyed and "
                                    f"partitioned as the seed says, published once they are committed; an "
                                    f"observation per slice counts its messages.", (table,), slices_partitions)
                 for table, stream in STREAMS.items()]
SPECS = INPUT_TOPICS + OUTPUT_TOPICS


def read_from(table: str) -> list[AssetKey]:
    """The input topics whose records a table of `ingest` holds: dead letters come from any of them;
    the Qlik schema registry and waits, from the ingestion topics."""
    if table == "dead_letters":
        return [spec.key for spec in INPUT_TOPICS]
    if table in ("avro_schemas", "schema_waits"):
        return [topic_key(INGESTION)]
    return [topic_key(s.name) for s in INPUT_STREAMS.values() if s.table == table] + (
        [topic_key(INGESTION)] if table == IngestionStream.table else [])
