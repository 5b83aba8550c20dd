"""Kafka reads and writes with confluent-kafka, usable on the driver and inside Spark tasks."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from entity_assets.slices import OffsetRange

PRODUCER_DEFAULTS = {
    "linger.ms": 20,
    "batch.num.messages": 10000,
    "compression.type": "lz4",
    "enable.idempotence": True,
    "acks": "all",
    "message.max.bytes": 4_000_000,
}


def end_offsets(config: dict, topics: list[str], timeout: float = 10.0) -> dict[tuple[str, int], int]:
    consumer = Consumer({**config, "group.id": "entity-assets-offsets", "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(timeout=timeout)
        out = {}
        for topic in topics:
            meta = metadata.topics.get(topic)
            if meta is None or meta.error is not None:
                continue
            for p in meta.partitions:
                _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout, cached=False)
                out[(topic, p)] = high
        return out
    finally:
        consumer.close()


def read_range(config: dict, r: OffsetRange, *, batch: int = 10_000, idle_timeout: float = 30.0) -> Iterator:
    """Yields the messages of [start, end) of one partition, in offset order.

    Offsets may have gaps (compaction, transaction markers), so the range ends at the first
    message at or past `end - 1`, or when the consumer's position reaches `end`.
    """
    if r.count <= 0:
        return
    consumer = Consumer(
        {
            **config,
            "group.id": "entity-assets-slices",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "fetch.max.bytes": 32 * 1024 * 1024,
            "queued.max.messages.kbytes": 65536,
        }
    )
    try:
        consumer.assign([TopicPartition(r.topic, r.partition, r.start)])
        last_progress = time.monotonic()
        while True:
            messages = consumer.consume(batch, timeout=1.0)
            for m in messages:
                err = m.error()
                if err is not None:
                    if err.code() == -191:  # _PARTITION_EOF
                        continue
                    raise KafkaException(err)
                if m.offset() >= r.end:
                    return
                yield m
                if m.offset() >= r.end - 1:
                    return
            if messages:
                last_progress = time.monotonic()
            else:
                position = consumer.position([TopicPartition(r.topic, r.partition)])[0].offset
                if position >= r.end:
                    return
                if time.monotonic() - last_progress > idle_timeout:
                    raise TimeoutError(f"{r.topic}[{r.partition}] stalled at {position} before {r.end}")
    finally:
        consumer.close()


def produce(config: dict, topic: str, records: Iterable[tuple[bytes | str | None, bytes | str]], *, partitioner: str | None = None) -> int:
    """Produces (key, value) records; the default partitioner hashes the key like Kafka's Java client."""
    producer = Producer({**config, **PRODUCER_DEFAULTS, "partitioner": partitioner or "murmur2_random"})
    n = 0
    for key, value in records:
        while True:
            try:
                producer.produce(topic, value=value, key=key)
                break
            except BufferError:
                producer.poll(0.05)
        n += 1
        if n % 10000 == 0:
            producer.poll(0)
    remaining = producer.flush(60)
    if remaining:
        raise RuntimeError(f"{remaining} records to {topic} were not delivered")
    return n


def ensure_topics(config: dict, topics: Iterable[str], partitions: int, timeout: float = 30.0) -> list[str]:
    """Creates the missing topics; returns the names it created."""
    admin = AdminClient(config)
    existing = set(admin.list_topics(timeout=timeout).topics)
    wanted = [t for t in dict.fromkeys(topics) if t not in existing]
    if not wanted:
        return []
    futures = admin.create_topics([NewTopic(t, num_partitions=partitions, replication_factor=1) for t in wanted])
    for topic, future in futures.items():
        try:
            future.result(timeout)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise
    return wanted
