"""Publishing derived streams back to Kafka, keyed and partitioned as the seed says.

Runs in Spark tasks, one per data file of the slice. Delivery is at least once: a re-run of a
slice publishes its messages again, and consumers dedupe on the message identity (request id
and part for responses, entity and version-bearing fields for updates). See docs/publishing.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow.parquet as pq

from entity_assets import core
from entity_assets.kafka_io import BatchProducer


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (the Java client's default partitioner), as an unsigned 32-bit int."""
    m, length = 0x5BD1E995, len(data)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = data[i] | data[i + 1] << 8 | data[i + 2] << 16 | data[i + 3] << 24
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail, rest = length & ~3, length % 4
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h ^= data[tail]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


@functools.lru_cache(maxsize=65536)
def partition_for(value: str, partitions: int) -> int:
    return (murmur2(value.encode()) & 0x7FFFFFFF) % partitions


def request_key(row: dict) -> str:
    return f"{row['clientid']}/{row['request']}"


@dataclass(frozen=True)
class Stream:
    """A derived stream's topic, message key, partitioning field (None: by key) and message."""

    name: str
    key: Callable[[dict], str]
    partition_by: str | None
    message: Callable[[dict], dict]


def _device_change(row: dict) -> dict:
    """changes-by-device: the device is the key, not part of the message (the seed)."""
    return {"dbid": row["dbid"], "db": row["dbid"], **{k: row[k] for k in
            ("collection", "zone", "entity", "notification", "action", "ended")}}


def _device_notification(row: dict) -> dict:
    return {"dbid": row["dbid"], "db": row["dbid"], **{k: row[k] for k in ("user", "device", "count", "begun", "ended")}}


STREAMS: dict[str, Stream] = {
    "entity_patches": Stream("entity-patches", lambda r: r["entity"], None, core.patch_message),
    "entity_updates": Stream("entity-updates", lambda r: r["entity"], None, core.result_message),
    "schema_updates": Stream("schema-updates", lambda r: r["dbid"], None, core.result_message),
    "schema_learning": Stream("schema-learning", lambda r: r["entity"] or r["dbid"], "collection", core.result_message),
    "partial_responses": Stream("partial-responses", request_key, "clientid", core.result_message),
    "complete_responses": Stream("complete-responses", request_key, "clientid", core.complete_message),
    "zone_changes": Stream("zone-changes", lambda r: r["entity"], "subjectZone", core.result_message),
    "changes_by_device": Stream("changes-by-device", lambda r: r["device"], None, _device_change),
    "device_notifications": Stream("device-notifications", lambda r: r["device"], None, _device_notification),
}


def publish_task(uris: Iterator[str], *, table: str, topic: str, partitions: int, kafka_config: dict) -> Iterator[int]:
    """mapPartitions body over data file URIs; yields the number of messages produced."""
    stream = STREAMS[table]
    producer = BatchProducer(kafka_config, topic)
    for uri in uris:
        for batch in pq.ParquetFile(uri).iter_batches(batch_size=20_000):
            for row in batch.to_pylist():
                partition = partition_for(row[stream.partition_by], partitions) if stream.partition_by else None
                producer.send(stream.key(row).encode(), core.dumps(stream.message(row)).encode(), partition)
    yield producer.close()
