"""Kafka reads and writes with confluent-kafka, usable on the driver and inside Spark tasks."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future

import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import (Consumer, ConsumerGroupTopicPartitions, IsolationLevel, KafkaError, KafkaException, Producer,
                             TopicPartition)
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec, ResourceType

from entity_assets.slices import OffsetRange
from entity_assets.storage import one_array

# zstd over whole batches: JSON messages of one stream share most of their bytes, and a broker
# stores (and the embedded one re-saves) batches as they were compressed; the pipeline
# publishes by the slice, so 50 ms of batching costs nothing a consumer would notice. Level 2:
# on the pipeline's messages as small as zstd's default (3) for two thirds of its CPU.
PRODUCER_DEFAULTS = {
    "linger.ms": 50,
    "batch.num.messages": 10000,
    "compression.type": "zstd",
    "compression.level": 2,
    "enable.idempotence": True,
    "acks": "all",
    "message.max.bytes": 4_000_000,
}


def producer_settings(config: dict) -> dict:
    """`PRODUCER_DEFAULTS` under `config`, with librdkafka's alias `compression.codec` named
    `compression.type`: one name, so what measures a message (`compressed_size`) uses the
    codec the producer does."""
    settings = dict(PRODUCER_DEFAULTS)
    for key, value in config.items():
        settings["compression.type" if key == "compression.codec" else key] = value
    return settings


def consumer_settings(config: dict) -> dict:
    """`config` for a consumer: librdkafka refuses one whose `fetch.max.bytes` is below
    `message.max.bytes`, which a deployment raises for its producers' large messages."""
    fetch = max(FETCH_BYTES, int(config.get("message.max.bytes", 0)))
    return {**config, "fetch.max.bytes": fetch,
            "receive.message.max.bytes": max(int(config.get("receive.message.max.bytes", 0)), fetch + 512)}


CONNECTING = ("bootstrap.servers", "security.protocol", "sasl.mechanism", "sasl.mechanisms")
"""Settings that make a client connect or load credentials (files, Kerberos, OIDC) when made."""


def refused_setting(config: Mapping[str, str]) -> str | None:
    """What librdkafka says of `config` (a deployment's extra settings) in a producer made as this
    project makes them, or in a consumer, or None if both take it: a property's name or value,
    or a clash with the producer's idempotence (`acks=1`). The clients made here connect nowhere
    (`CONNECTING` left out), so the code location's load says it, not each run after its retries."""
    inert = {key: value for key, value in config.items() if key not in CONNECTING}
    try:
        Producer({**producer_settings(inert), "logger": _SILENT})
        Consumer({**consumer_settings(inert), "group.id": "entity-assets-settings", "logger": _SILENT}).close()
    except KafkaException as exc:
        return exc.args[0].str()
    except (ValueError, TypeError) as exc:  # message.max.bytes that is no number; a callback's name (error_cb)
        return str(exc)
    return None


_SILENT = logging.getLogger(f"{__name__}.settings")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False


SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")
"""librdkafka's SASL mechanisms, by the names it compares case by case when a client is made;
GSSAPI (Kerberos), its default, only where it was built with libsasl2 (`has_gssapi`)."""


def has_gssapi() -> bool:
    """Whether this librdkafka has GSSAPI: the confluent-kafka wheel the project pins has not,
    and a client with it fails as it is made (`No provider for SASL mechanism GSSAPI`)."""
    try:
        Producer({"builtin.features": "sasl_gssapi", "logger": _SILENT})
    except KafkaException:
        return False
    return True


FETCH_BYTES = 32 * 1024 * 1024
"""A fetch's bytes at most: several `consume` batches of the largest messages."""


class KafkaUnreachable(RuntimeError):
    """Kafka gave no metadata: the broker is down, or the bootstrap servers or security settings are wrong."""


class DeliveryFailed(RuntimeError):
    """Records a producer did not deliver: the cluster refused them or did not answer in time."""


class _LastError(logging.Handler):
    """Keeps the last error librdkafka logged for one client, instead of the line per reconnect
    (ten a second) that it prints to stderr by default."""

    def __init__(self) -> None:
        super().__init__()
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.last = record.getMessage().split("]: ", 1)[-1]

    @classmethod
    def logger(cls, name: str) -> tuple[_LastError, logging.Logger]:
        """A client's `logger` setting, and the handler that keeps its last error."""
        cause, logger = cls(), logging.Logger(name)  # unregistered: freed with the client
        logger.addHandler(cause)
        return cause, logger


def cluster_metadata(config: dict, timeout: float = 10.0, client: Consumer | AdminClient | None = None,
                     cause: _LastError | None = None):
    """`list_topics` of `client` (default: an admin client). No answer raises an error naming the
    servers asked (a sensor tick or a command shows it), where librdkafka's names none, and the
    cause librdkafka last logged (refused, TLS, SASL) to `cause`, the client's logger's handler."""
    if client is None:
        cause, logger = _LastError.logger("entity_assets.kafka_metadata")
        client = AdminClient({**config, "logger": logger})
    try:
        return client.list_topics(timeout=timeout)
    except KafkaException as exc:
        if cause is not None:
            client.poll(0)  # serves the logged lines to the handler
        detail = f"{exc.args[0].str()}" + (f"; {cause.last}" if cause is not None and cause.last else "")
        raise KafkaUnreachable(f"Kafka at {config['bootstrap.servers']} gave no metadata within {timeout:g} s "
                               f"({detail}): is the broker up, and are the bootstrap servers and "
                               "security settings right? (docs/operations.md)") from exc


def watermarks(config: dict, topics: Iterable[str] | Callable[[str], bool], timeout: float = 10.0,
               unanswered: list[str] | None = None,
               expected: Iterable[str] = ()) -> dict[tuple[str, int], tuple[int, int]]:
    """(first offset held, end offset) of every partition of `topics` (names, or a test of the
    broker's names).

    The end offset is the last stable offset (`isolation.level` read_committed, the consumers'
    default, unless the client config says read_uncommitted): a slice ends where its readers can
    reach, not inside a transaction still open. Every partition is asked at once, in one
    ListOffsets request per leader broker for each end, so no partition waits behind others.

    A partition that gives none (no leader: an election, a broker down) raises, or with
    `unanswered` is left out and named there, so that one partition of one topic does not hold
    back every other; no partition answering raises still. One the metadata says has no leader
    is not asked (librdkafka would wait out `timeout` for it), and all the asking shares one
    `timeout`: a sensor's tick has 60 s. A topic given by name (in `topics`, or `expected` beside
    a test) that the metadata lacks or gives an error for (not created; no Describe right: Kafka
    leaves those out) raises nothing, and is named in `unanswered` unless no partition answered:
    an empty answer with nothing unanswered says the cluster has none of them (a mistyped
    prefix, another cluster)."""
    cause, logger = _LastError.logger("entity_assets.kafka_offsets")
    admin = AdminClient({**config, "logger": logger})  # held until the answers are in: freed, it ends its requests
    metadata = cluster_metadata(config, timeout, admin, cause)
    deadline = time.monotonic() + timeout
    failed, lacking, by_leader = [], [], {}
    named = dict.fromkeys(expected if callable(topics) else topics)
    for topic in dict.fromkeys([*(t for t in metadata.topics if topics(t)), *named] if callable(topics) else named):
        meta = metadata.topics.get(topic)
        if meta is None or meta.error is not None:
            if topic in named:
                reason = ("not in the cluster's metadata: not created, or not Describe-able" if meta is None
                          else meta.error.str())
                lacking.append(f"{topic} ({reason})")
            continue
        for p, partition in meta.partitions.items():
            if partition.leader < 0:  # (a partition error alone, REPLICA_NOT_AVAILABLE, reads)
                failed.append(f"{topic} partition {p} (no leader)")
            else:
                by_leader.setdefault(partition.leader, []).append(TopicPartition(topic, p))
    isolation = (IsolationLevel.READ_UNCOMMITTED if str(config.get("isolation.level", "")).lower() == "read_uncommitted"
                 else IsolationLevel.READ_COMMITTED)
    left = max(deadline - time.monotonic(), 0.001)
    answers: list[dict[tuple[str, int], Future]] = [{}, {}]  # first offsets, end offsets
    for partitions in by_leader.values():
        for answer, spec in zip(answers, (OffsetSpec.earliest(), OffsetSpec.latest())):
            futures = admin.list_offsets({tp: spec for tp in partitions}, isolation_level=isolation, request_timeout=left)
            answer.update(((tp.topic, tp.partition), future) for tp, future in futures.items())
    out = {}
    for partitions in by_leader.values():
        for tp in partitions:
            key = (tp.topic, tp.partition)
            try:  # librdkafka ends each request at the deadline: a second more only spares a race
                out[key] = tuple(a[key].result(max(deadline - time.monotonic(), 0) + 1).offset for a in answers)
            except KafkaException as exc:
                failed.append(f"{tp.topic} partition {tp.partition} ({exc.args[0].str()})")
            except TimeoutError:
                failed.append(f"{tp.topic} partition {tp.partition} (out of time)")
    if failed and (unanswered is None or not out):
        raise KafkaUnreachable(f"Kafka at {config['bootstrap.servers']} gave no offsets of {'; '.join(failed)}: "
                               "the next look asks again")
    if unanswered is not None:
        unanswered.extend(failed + (lacking if out else []))
    return out


def end_offsets(config: dict, topics: Iterable[str] | Callable[[str], bool],
                timeout: float = 10.0) -> dict[tuple[str, int], int]:
    """End offsets (`watermarks`) of every partition of `topics`."""
    return {tp: high for tp, (_, high) in watermarks(config, topics, timeout).items()}


SLICES_GROUP = "entity-assets-slices"
"""The consumer group the slices are read as, unless the client config names one."""


def commit_offsets(config: dict, positions: Mapping[tuple[str, int], int], timeout: float = 10.0) -> str:
    """Commits `positions` (each partition's next offset) to the group the slices are read as, and
    returns the group: Kafka's lag tools (`kafka-consumer-groups --describe`, lag exporters) then
    show how far the lake is behind. Nothing reads them back: the manifests hold the offsets.
    An admin client's commit, as the group has no members (the readers assign their partitions)."""
    group = config.get("group.id", SLICES_GROUP)
    cause, logger = _LastError.logger("entity_assets.kafka_commit")
    admin = AdminClient({**{k: v for k, v in config.items() if k != "group.id"}, "logger": logger})
    offsets = [TopicPartition(topic, partition, offset) for (topic, partition), offset in sorted(positions.items())]
    future = admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(group, offsets)],
                                                request_timeout=timeout)[group]
    try:
        answer = future.result(timeout + 1)
    except (KafkaException, TimeoutError) as exc:
        detail = (exc.args[0].str() if isinstance(exc, KafkaException) else "no answer") + (
            f"; {cause.last}" if cause.last else "")
        raise OffsetsNotCommitted(f"group {group}: {detail}") from exc
    refused = [f"{tp.topic}[{tp.partition}]: {tp.error.str()}" for tp in answer.topic_partitions if tp.error]
    if refused:
        raise OffsetsNotCommitted(f"group {group}: {'; '.join(refused[:5])}")
    return group


class OffsetsNotCommitted(RuntimeError):
    """The cluster did not take a commit of the slices' offsets (`commit_offsets`)."""


class RecordsExpired(Exception):
    """Offsets of a range that its partition no longer holds: Kafka's retention (or a delete of
    records) removed them before they were read, the topic was deleted (and maybe created again,
    or with fewer partitions), or an unclean leader election cut its log short."""

    def __init__(self, topic: str, partition: int, start: int, stop: int):
        super().__init__(topic, partition, start, stop)  # picklable across Spark workers
        self.topic, self.partition, self.start, self.stop = topic, partition, start, stop

    def __str__(self) -> str:
        return (f"{self.topic}[{self.partition}] no longer holds offsets [{self.start}, {self.stop}): Kafka's "
                "retention deleted them before they were read, or the topic was deleted (or created again, or "
                "its log cut short)")

    @staticmethod
    def span(reason: str) -> range | None:
        """The offsets a dead letter's reason (`str` of one) names as gone."""
        found = _SPAN.search(reason)
        return range(int(found[1]), int(found[2])) if found else None


_SPAN = re.compile(r"no longer holds offsets \[(\d+), (\d+)\)")


def _expired(consumer: Consumer, r: OffsetRange, offset: int, config: dict | None = None) -> RecordsExpired | None:
    """The offsets of `r` from `offset` on that its partition no longer holds, or None if it holds `offset`.

    `config`: the partition's end is asked again counting the records of transactions still
    open, which a read_committed consumer's end (the last stable offset) leaves out: a range
    can end past it when the readers' isolation differs from the sensor's that closed it, and
    those records are not gone, only not readable yet."""
    low, high = consumer.get_watermark_offsets(TopicPartition(r.topic, r.partition), timeout=10.0, cached=False)
    if offset < low:
        return RecordsExpired(r.topic, r.partition, offset, min(low, r.end))
    if offset >= high and (config is None or _written_end(config, r) <= offset):  # fewer records than at the close
        return RecordsExpired(r.topic, r.partition, offset, r.end)
    return None


ABSENT_AFTER = 5.0
"""Seconds without a record after which a reader asks whether its partition is still there, and
after which a "no" is asked again before the reader takes it."""


def _absent(consumer: Consumer, r: OffsetRange) -> bool:
    """Whether the cluster says `r`'s partition is not there: its topic unknown by name (deleted;
    its records with it) or with fewer partitions. librdkafka reports neither to a reader of an
    assigned partition, which waits; a topic the client may not describe is no absent one."""
    try:
        meta = consumer.list_topics(topic=r.topic, timeout=10.0).topics.get(r.topic)
    except KafkaException:
        return False  # no answer: nothing said
    if meta is None or meta.error is not None:
        return meta is None or meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
    return r.partition not in meta.partitions


def _written_end(config: dict, r: OffsetRange) -> int:
    """The partition's high watermark, the records of open transactions counted."""
    marks = watermarks({**config, "isolation.level": "read_uncommitted"}, [r.topic], 10.0, [])  # only its own answer counts
    return marks[(r.topic, r.partition)][1]


def read_range(config: dict, r: OffsetRange, *, batch: int = 10_000, idle_timeout: float = 30.0,
               expired: Callable[[RecordsExpired], None] | None = None) -> Iterator:
    """Yields the messages of [start, end) of one partition, in offset order.

    Offsets may have gaps (compaction, transaction markers), so the range ends at the first
    message at or past `end - 1`, or when the consumer's position reaches `end`. Offsets the
    partition no longer holds raise `RecordsExpired`, or with `expired` are passed to it and
    skipped: never silently, as librdkafka's offset reset would. So do those past a partition
    that now ends before the range does (a topic created again with fewer records, a log cut
    short by an unclean leader election), told when the read reaches its end, not after
    `idle_timeout`: that stall raises TimeoutError only while the partition holds more, and
    the offsets of a partition that is no longer there (a topic deleted; fewer partitions).
    """
    if r.count <= 0:
        return
    consumer = Consumer(
        {
            "group.id": SLICES_GROUP,  # the client config's, if it names one (a cluster's ACLs)
            **consumer_settings(config),
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "error",
            # a shallow prefetch: two `consume` batches. With librdkafka's default (100k
            # messages), a consumer slower than the fetches (a task validating as it reads)
            # costs the embedded broker 20-40 CPU-us per message instead of under 2.
            "queued.min.messages": 2 * batch,
            "queued.max.messages.kbytes": 65536,
        }
    )
    try:
        consumer.assign([TopicPartition(r.topic, r.partition, r.start)])
        last_progress, absent_since = time.monotonic(), None
        next_offset = r.start
        while True:
            # consume() waits for num_messages or the timeout: never ask for more than the range holds
            messages = consumer.consume(max(1, min(batch, r.end - next_offset)), timeout=1.0)
            gone, at_end = None, False
            for m in messages:
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        at_end = True
                        continue
                    if err.code() != KafkaError._AUTO_OFFSET_RESET:
                        raise KafkaException(err)
                    gone = _expired(consumer, r, next_offset)
                    if gone is None:
                        raise KafkaException(err)
                    break
                if m.offset() >= r.end:
                    return
                yield m
                next_offset = m.offset() + 1
                if m.offset() >= r.end - 1:
                    return
            if gone is None and (at_end or not messages):
                # invalid (negative) until the consumer has fetched: next_offset then
                position = max(next_offset, consumer.position([TopicPartition(r.topic, r.partition)])[0].offset)
                if position >= r.end:
                    return
                stalled = not messages and time.monotonic() - last_progress > idle_timeout
                if at_end or stalled:  # the partition may end before the range does
                    try:
                        gone = _expired(consumer, r, position, config)
                    except (KafkaException, KafkaUnreachable, KeyError):  # no answer: its end unknown, a stall stays one
                        gone = None
                    if gone is None and stalled:
                        raise TimeoutError(f"{r.topic}[{r.partition}] stalled at {position} before {r.end}")
                elif not messages and time.monotonic() - last_progress > ABSENT_AFTER:
                    # said again ABSENT_AFTER later: a broker just restarted answers so until its metadata is in
                    if not _absent(consumer, r):
                        absent_since = None
                    elif absent_since is None:
                        absent_since = time.monotonic()
                    elif time.monotonic() - absent_since > ABSENT_AFTER:
                        gone = RecordsExpired(r.topic, r.partition, position, r.end)
            if messages:
                last_progress, absent_since = time.monotonic(), None
            if gone is not None:
                if expired is None:
                    raise gone
                expired(gone)
                if gone.stop >= r.end:
                    return
                next_offset = gone.stop
                consumer.assign([TopicPartition(r.topic, r.partition, next_offset)])
    finally:
        consumer.close()


class _Client:
    """A librdkafka producer and the delivery failures reported to it while one BatchProducer holds it."""

    def __init__(self, settings: dict):
        errors: list = []

        def on_delivery(err, _msg) -> None:
            if err is not None:
                errors.append(err)

        # a closure, not a bound method: no cycle through the producer, so a dropped (failed)
        # one ends with its last holder instead of retrying its broker until a garbage collection
        self.errors = errors
        self.producer = Producer({**settings, "on_delivery": on_delivery})


_IDLE: dict[tuple, list[_Client]] = {}
"""Producers that a BatchProducer closed cleanly, by (process id, settings), for the next one of
that process: a forked child neither takes nor ends its parent's, whose librdkafka threads it lacks."""


def warm_producer(config: dict) -> None:
    """Readies a producer of `config` for this process's next publish unless one is idle: it gets
    its producer id (0.5 s after its start, see BatchProducer) while the caller goes on."""
    BatchProducer(config).close()  # nothing sent: the close returns at once and keeps it


def release_producers() -> None:
    """Ends the idle producers of this process (each flushed when it was closed)."""
    pid = os.getpid()
    for key in [k for k in _IDLE if k[0] == pid]:
        for client in _IDLE.pop(key):
            client.producer.close()


def _produce(client: _Client, topic: str, value, key, partition: int) -> None:
    """One record (`partition` -1: Kafka's murmur2 of the key picks it), waiting out a full queue.

    A record librdkafka refuses at once (a partition it knows the topic lacks) is a failed
    delivery like any other: `close` reports it. Whether librdkafka refuses at once or later
    depends on whether it has read the topic's metadata yet. A full queue with failed deliveries
    already reported is a cluster that does not take them: DeliveryFailed at once, not after
    every queued record timed out in turn (minutes per 100,000 records).
    """
    while True:
        try:
            client.producer.produce(topic, value, key, partition)
            return
        except BufferError:
            client.producer.poll(0.05)
            if client.errors:
                raise DeliveryFailed(f"producing to {topic} failed: {client.errors[:3]}") from None
        except KafkaException as exc:
            client.errors.append(exc.args[0])
            return


class BatchProducer:
    """An idempotent producer that waits out full queues and fails loudly on undelivered records.

    Its librdkafka producer is handed to the next BatchProducer of the same settings in this
    process once it closed cleanly: a new idempotent producer delivers nothing before librdkafka
    asks for its producer id, 0.5 s after start (no broker is up at its creation), a wait that
    each step of a small slice paid for its publish.
    """

    def __init__(self, config: dict):
        # the resource's settings (client_config) override the defaults; delivery reports for
        # failed records only: no Python callback per delivered record
        settings = {**producer_settings(config), "partitioner": "murmur2_random", "delivery.report.only.error": True}
        self._key = (os.getpid(), tuple(sorted(settings.items())))
        idle = _IDLE.get(self._key)
        self._client = idle.pop() if idle else _Client(settings)
        self._producer = self._client.producer
        self.counts: dict[str, int] = {}
        self._sent = 0

    def send(self, topic: str, key: bytes | str | None, value: bytes | str, partition: int | None = None) -> None:
        """Without `partition`, Kafka's murmur2 of the key picks it, like the Java client. Text is sent as UTF-8."""
        _produce(self._client, topic, value, key, -1 if partition is None else partition)
        self.counts[topic] = self.counts.get(topic, 0) + 1
        self._sent += 1
        if self._sent % 10000 == 0:
            self._producer.poll(0)

    def send_spooled(self, batch: pa.RecordBatch, topics: list[str]) -> None:
        """A batch of a spool (`Spool.SCHEMA`; topic indexes into `topics`): `send` of each record,
        with the bookkeeping done once for the batch, which holds one topic's records."""
        span = pc.min_max(batch.column("topic")).as_py()
        if span["min"] != span["max"]:
            raise ValueError("a spool batch holds the records of one topic (Spool.send_batch)")
        topic = topics[span["min"]]
        keys, values = batch.column("key").to_pylist(), batch.column("value").to_pylist()
        producer = self._producer
        produce = producer.produce  # the loop calls it straight: a Python call per record is a sixth of a replay
        for key, value, partition in zip(keys, values, batch.column("partition").to_pylist()):
            try:
                produce(topic, value, key, partition)  # partition -1: librdkafka's murmur2 of the key
            except (BufferError, KafkaException):
                _produce(self._client, topic, value, key, partition)
        self.counts[topic] = self.counts.get(topic, 0) + batch.num_rows
        self._sent += batch.num_rows
        producer.poll(0)

    def close(self, timeout: float = 120) -> dict[str, int]:
        """Waits for every record; returns the count per topic. A producer that failed is not reused."""
        remaining = self._producer.flush(timeout)
        errors = self._client.errors
        if remaining or errors:
            raise DeliveryFailed(f"producing to {sorted(self.counts)} failed: "
                               f"{errors[:3] or f'{remaining} undelivered'}")
        _IDLE.setdefault(self._key, []).append(self._client)
        return self.counts


class Spool:
    """Kafka records written to a file (`sink`, any binary output stream), produced later by `replay_into`.

    A step's tasks spool their messages while they write their rows; the step replays every
    spool in one burst once the rows are committed (see `publish`). The embedded broker
    re-saves everything it holds after each second it was written to (about a CPU-second per
    save at 1.5M messages held), so each separate burst costs it a save or two: a step's
    tasks sending as each ends cost it several. Memory stays flat: the file is written as it grows.

    The file is an Arrow IPC stream of `SCHEMA` batches: a batch of messages made from rows in
    Arrow is written as its columns, with no work per record.
    """

    SCHEMA = pa.schema([("topic", pa.int16()), ("partition", pa.int32()), ("key", pa.binary()), ("value", pa.binary())])
    """topic: index in the spool's topics, one per batch; partition: -1 where Kafka's murmur2 of the key picks it."""

    def __init__(self, sink, topics: list[str]):
        self._sink, self._topics = sink, {t: i for i, t in enumerate(topics)}
        self._writer = pa.ipc.new_stream(sink, self.SCHEMA)
        self.count = 0

    def send_batch(self, topic: str, keys: pa.Array | pa.ChunkedArray, values: pa.Array | pa.ChunkedArray,
                   partitions: list[int] | None = None) -> None:
        """Records of one topic (text sent as UTF-8), after those sent before; `partitions` None:
        Kafka's murmur2 of each key picks it, as `BatchProducer.send` does. The records reach Kafka
        when `replay_into` produces the spool."""
        n = len(values)
        if not n:
            return
        self._writer.write_batch(pa.record_batch([
            pa.repeat(pa.scalar(self._topics[topic], pa.int16()), n),
            pa.repeat(pa.scalar(-1, pa.int32()), n) if partitions is None else pa.array(partitions, pa.int32()),
            *(one_array(c).cast(pa.binary()) for c in (keys, values))], schema=self.SCHEMA))
        self.count += n

    def close(self) -> None:
        self._writer.close()
        self._sink.close()


def spooled(source) -> Iterator[pa.RecordBatch]:
    """A spool's records (`source`: a binary input stream), in `Spool.SCHEMA` batches."""
    yield from pa.ipc.open_stream(source)


def replay_into(producer: BatchProducer, source, topics: list[str]) -> None:
    """Sends every record of a spool (`source`: a binary input stream) through `producer`."""
    for batch in spooled(source):
        producer.send_spooled(batch, topics)


def produce(config: dict, topic: str, records: Iterable[tuple[bytes | str | None, bytes | str]]) -> int:
    """Produces (key, value) records; returns how many."""
    producer = BatchProducer(config)
    for key, value in records:
        producer.send(topic, key, value)
    return producer.close().get(topic, 0)


BATCH_FRAMING = 512
"""Bytes of a record batch besides its one record's key and value, with room to spare."""


def message_limits(config: dict, topics: Iterable[str], timeout: float = 10.0) -> dict[str, int]:
    """The largest record (key and value bytes, as compressed) each topic takes: its
    `max.message.bytes`, which the broker holds a whole compressed batch to, less a batch's
    framing. A topic the cluster does not describe (no DescribeConfigs right, no answer in
    time) is left out: its limit is not known, and nothing is held back for it."""
    resources = [ConfigResource(ResourceType.TOPIC, t) for t in topics]
    if not resources:
        return {}
    cause, logger = _LastError.logger("entity_assets.kafka_limits")
    admin = AdminClient({**config, "logger": logger})  # held until the answers are in: freed, it ends its requests
    futures = admin.describe_configs(resources, request_timeout=timeout)
    limits = {}
    for resource, future in futures.items():
        try:
            entry = future.result(timeout + 1).get("max.message.bytes")
        except (KafkaException, TimeoutError):
            continue
        if entry is not None and entry.value:
            limits[resource.name] = int(entry.value) - BATCH_FRAMING
    return limits


def producer_limit(config: dict) -> int:
    """The largest record (key and value bytes, uncompressed) the producer sends: librdkafka
    refuses a larger one itself (`message.max.bytes`)."""
    return int(producer_settings(config)["message.max.bytes"]) - BATCH_FRAMING


COMPRESSION_LEVELS = {"gzip": (6, 0, 9), "zstd": (3, 0, 22), "lz4": (1, 1, 12)}
"""Codec -> (the level librdkafka compresses at for `compression.level` -1, and the least and
greatest it compresses at) in Arrow's terms: Arrow's own defaults (gzip 9, zstd 1) are not
librdkafka's (zlib's 6, zstd's 3), and a message measured smaller than it is sent passes the
check for the broker to refuse. lz4's levels 0 to 2 are all LZ4's fast mode, Arrow's 1."""


def compressed_size(value: bytes, config: dict) -> int:
    """The bytes of `value` once the producer's codec has compressed it, as the broker measures a
    batch against its topic's limit (a record that large is alone in its batch: `batch.size`).
    The codec's name is librdkafka's, of any case."""
    settings = producer_settings(config)
    codec = str(settings["compression.type"]).lower()
    if codec not in ("zstd", "gzip", "lz4", "snappy") or not pa.Codec.is_available(codec):
        return len(value)
    if codec == "snappy":
        return pa.Codec(codec).compress(value).size
    default, least, greatest = COMPRESSION_LEVELS[codec]
    level = int(settings.get("compression.level", -1))
    level = default if level == -1 else min(max(level, least), greatest)
    return pa.Codec(codec, compression_level=level).compress(value).size


def partition_counts(config: dict, topics: Iterable[str], timeout: float = 30.0) -> dict[str, int]:
    """Partitions of each existing topic, from one metadata request."""
    metadata = cluster_metadata(config, timeout)
    return {t: len(metadata.topics[t].partitions) for t in topics if t in metadata.topics}


def ensure_topics(config: dict, topics: Iterable[str], partitions: int, timeout: float = 30.0,
                  topic_configs: Mapping[str, dict[str, str]] | None = None, replication_factor: int = -1) -> list[str]:
    """Creates the missing topics (each with its `topic_configs` entry, e.g. retention); returns
    the names it created. `replication_factor` -1 is the cluster's `default.replication.factor`:
    one replica would lose the topic with its broker, and a cluster whose `min.insync.replicas`
    is 2 would refuse every write of the idempotent producer (acks=all) to it."""
    admin = AdminClient(config)
    existing = set(cluster_metadata(config, timeout, admin).topics)
    wanted = [t for t in dict.fromkeys(topics) if t not in existing]
    if not wanted:
        return []
    configs = topic_configs or {}
    futures = admin.create_topics([NewTopic(t, num_partitions=partitions, replication_factor=replication_factor,
                                            config=dict(configs.get(t, {}))) for t in wanted])
    for topic, future in futures.items():
        try:
            future.result(timeout)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise
    # a broker's metadata may lack a topic for a moment after its creation: the publish that
    # follows counts its partitions
    deadline = time.monotonic() + timeout
    while lacking := _unlisted(cluster_metadata(config, timeout, admin), wanted):
        if time.monotonic() > deadline:
            raise KafkaUnreachable(f"Kafka at {config['bootstrap.servers']} created {', '.join(lacking)} but lists "
                                   f"no partitions of it after {timeout:g} s")
        time.sleep(0.1)
    return wanted


def _unlisted(metadata, topics: Iterable[str]) -> list[str]:
    """The topics of `topics` that `metadata` lists no partition of."""
    return [t for t in topics if (listed := metadata.topics.get(t)) is None or listed.error is not None
            or not listed.partitions]
