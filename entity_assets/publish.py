"""Publishing derived streams back to Kafka, keyed and partitioned as the seed says.

The Spark tasks that write the rows encode their messages as they go and spool them to the
step's outbox (a folder of the lake); once the driver has committed the rows, one Spark job
replays every spool of the step (`replay_task`), so consumers never see a message of a row
that is not committed, and the broker takes a step's messages in one burst. Delivery is at
least once: a failed slice's re-run publishes its messages again (the same bytes, as outputs
are deterministic; a slice older than the newest published only when told to, see
`assets.common.publishes_slice`), and consumers dedupe on the message identity (request id and part, with the
entity for updates; `notification` for changes by device). See docs/streams.md.
"""

from __future__ import annotations

import functools
import io
import json
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from entity_assets import core, encode, messages
from entity_assets.kafka_io import BatchProducer, Spool, compressed_size, producer_limit, replay_into
from entity_assets.storage import filesystem, one_array

SPOOL_READ_BUFFER = 4 << 20
"""Bytes read from a spool at a time."""

OUTBOX = "outbox:"
"""Report rows with this table name are a task's spool file (path: its URI, rows: its messages)."""
UNDELIVERABLE = "undeliverable:"
"""Report rows with this table name are a message too large for its topic, which no spool holds
(stats: its stream, key, bytes, compressed bytes and the topic's limit); counters
`undeliverable:<table>` count them."""
EXAMPLES = 20
"""Messages too large that a task reports by key: its counters count them all."""


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


CACHED_VALUE_CHARS = 256
"""Partitioning values (zones, collections, client ids) cached at most: a name may be as long as
a message, and a slice of long ones would stay in a worker's cache for good."""


def partitions_for(values: list[str], partitions: int) -> list[int]:
    return [partition_for(v, partitions) if len(v) <= CACHED_VALUE_CHARS else partition_for.__wrapped__(v, partitions)
            for v in values]


def request_key_of(row: dict) -> str:
    return messages.request_key(row["clientid"], row["request"])


@dataclass(frozen=True)
class Stream:
    """A derived stream's topic, message key, partitioning field (None: by key) and message text.

    `key` and `encode` define them for one row; tasks use `keys` and `texts`, the same of rows
    held in Arrow a batch at a time (`Publisher.send_rows`), which tests/test_encode.py holds equal.
    """

    name: str
    key: Callable[[dict], str]
    partition_by: str | None
    encode: Callable[[dict], str]
    keys: Callable[[pa.Table], pa.Array | pa.ChunkedArray]
    texts: Callable[[pa.Table], pa.Array]


def _column(name: str) -> Callable[[pa.Table], pa.ChunkedArray]:
    """Keys of rows in Arrow that are one of their columns."""
    return lambda rows: rows.column(name)


def _by_entity_or_dbid(rows: pa.Table) -> pa.Array:
    """schema-learning: an entity message by its entity, an entity-type message (no entity) by its database."""
    entity = rows.column("entity")
    return pc.if_else(pc.fill_null(pc.not_equal(entity, ""), False), entity, rows.column("dbid"))


def _by_request(rows: pa.Table) -> pa.Array:
    """`request_key_of` each row."""
    return pc.binary_join_element_wise(rows.column("clientid"), pc.cast(rows.column("request"), pa.string()), "/")


CHANGE_BY_DEVICE = ("collection", "zone", "entity", "notification", "action", "ended")
"""changes-by-device: the device is the key, not part of the message (the seed)."""
DEVICE_NOTIFICATION = ("user", "device", "count", "begun", "ended")


def _change_by_device(row: dict) -> str:
    return core.dumps({"dbid": row["dbid"], "db": row["dbid"], **{k: row[k] for k in CHANGE_BY_DEVICE}})


def _device_notification(row: dict) -> str:
    return core.dumps({"dbid": row["dbid"], "db": row["dbid"], **{k: row[k] for k in DEVICE_NOTIFICATION}})


STREAMS: dict[str, Stream] = {
    "entity_patches": Stream("entity-patches", lambda r: r["entity"], None, core.patch_json, _column("entity"),
                             encode.patch_texts),
    "entity_updates": Stream("entity-updates", lambda r: r["entity"], None, core.result_json, _column("entity"),
                             encode.result_texts),
    "schema_updates": Stream("schema-updates", lambda r: r["dbid"], None, core.result_json, _column("dbid"),
                             encode.result_texts),
    "schema_learning": Stream("schema-learning", lambda r: r["entity"] or r["dbid"], "collection", core.result_json,
                              _by_entity_or_dbid, encode.result_texts),
    "partial_responses": Stream("partial-responses", request_key_of, "clientid", core.result_json, _by_request,
                                encode.result_texts),
    "complete_responses": Stream("complete-responses", request_key_of, "clientid", core.complete_json, _by_request,
                                 encode.complete_texts),
    "zone_changes": Stream("zone-changes", lambda r: r["entity"], "subjectZone", core.result_json, _column("entity"),
                           encode.result_texts),
    "changes_by_device": Stream("changes-by-device", lambda r: r["device"], None, _change_by_device, _column("device"),
                                lambda rows: encode.object_texts(rows, CHANGE_BY_DEVICE, database=True)),
    "device_notifications": Stream("device-notifications", lambda r: r["device"], None, _device_notification,
                                   _column("device"),
                                   lambda rows: encode.object_texts(rows, DEVICE_NOTIFICATION, database=True)),
}


def process() -> str:
    """This process, told apart from one of another host or container that has the same pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Publishing:
    """Where a step publishes: the Kafka settings, per table its topic and partition count, and
    the outbox folder its tasks spool to.

    Built once per step on the driver (topics and outbox created there), shipped to the tasks.
    Tasks that run in the process `held_by` names (a small slice's, in the driver) keep their
    spools in `held`, by URI, for the step to replay from there: on an object store a spool
    file costs six requests in a row (its upload, then a HEAD and a GET, a HEAD and a DELETE,
    and the folder marker pyarrow writes back).
    """

    kafka_config: dict = field(repr=False)  # its secrets, resolved: never in a message
    topics: dict[str, tuple[str, int]]
    outbox: str
    storage_options: dict | None = field(default=None, repr=False)
    held_by: str | None = None
    """`process()` of the step's driver."""
    limits: dict[str, int] = field(default_factory=dict)
    """Per table, the largest message (key and value bytes, compressed) its topic takes
    (`kafka_io.message_limits`; the producer's limit where the cluster does not tell)."""
    held: dict[str, pa.Buffer] = field(default_factory=dict, compare=False, repr=False)

    def __getstate__(self) -> dict:
        """Shipped to tasks without the held spools, which only this process's tasks fill and read."""
        return {**self.__dict__, "held": {}}


HELD_BYTES = 64 * 1024 * 1024
"""Spool bytes a step's driver holds at most: past them, its tasks spool to files as a large
slice's do (a small slice's documents may be large: 1,000 patches of 100 KB documents spool
400 MB)."""


class _Held:
    """A spool's sink kept in memory until it passes `budget` bytes, then the file `spill` opens."""

    def __init__(self, budget: int, spill):
        self._memory: io.BytesIO | None = io.BytesIO()
        self._file, self._budget, self._spill = None, budget, spill
        self.closed = False

    def write(self, data) -> int:
        if self._memory is not None and self._memory.tell() + len(data) > self._budget:
            self._file = self._spill()
            self._file.write(self._memory.getbuffer())
            self._memory = None
        return (self._file or self._memory).write(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self.closed = True

    def held(self) -> pa.Buffer | None:
        """The spool, None where it went to its file."""
        return None if self._memory is None else pa.py_buffer(self._memory.getvalue())


class Publisher:
    """Publishes rows from inside a task: their messages are made as their rows are written, a
    batch at a time, and spooled to a file of the outbox, which the step replays once the rows
    are committed."""

    def __init__(self, publishing: Publishing):
        self.publishing, self.topics = publishing, publishing.topics
        self._targets = {table: (topic, partitions, STREAMS[table]) for table, (topic, partitions) in self.topics.items()}
        self.spool: Spool | None = None  # on first use: a task with nothing to send writes no file
        self.uri = ""
        self._memory: _Held | None = None
        self.undeliverable: dict[str, int] = {}
        self.examples: list[dict] = []

    def _spool(self) -> Spool:
        if self.spool is None:
            self.uri = f"{self.publishing.outbox}/{uuid.uuid4().hex}.spool"
            if self.publishing.held_by == process():
                budget = HELD_BYTES - sum(len(spool) for spool in self.publishing.held.values())
                sink = self._memory = _Held(budget, self._file)
            else:
                sink = self._file()
            self.spool = Spool(sink, [topic for topic, _ in self.topics.values()])
        return self.spool

    def _file(self):
        fs, path = filesystem(self.uri, self.publishing.storage_options)
        return fs.open_output_stream(path)

    def publishes(self, table: str) -> bool:
        return table in self._targets

    def send_rows(self, table: str, rows: pa.Table, texts: pa.Array | None = None) -> None:
        """Spools the messages of rows held in Arrow, made a batch at a time (`Stream.texts`).

        `texts`: the messages when the caller already made them.
        """
        target = self._targets.get(table)
        if target is None:
            return
        topic, partitions, stream = target
        keys, texts = one_array(stream.keys(rows)), stream.texts(rows) if texts is None else texts
        limit = self.publishing.limits.get(table)
        if limit is not None and (fits := self._fitting(table, stream, keys, texts, limit)) is not None:
            rows, keys, texts = rows.filter(fits), keys.filter(fits), texts.filter(fits)
            if not rows.num_rows:
                return
        by = None if stream.partition_by is None else partitions_for(rows.column(stream.partition_by).to_pylist(),
                                                                     partitions)
        self._spool().send_batch(topic, keys, texts, by)

    def _fitting(self, table: str, stream: Stream, keys: pa.Array, texts, limit: int) -> pa.Array | None:
        """Which messages their topic takes (None: all): key and value within `limit`, or past it
        once the producer's codec has compressed the value (the broker measures the compressed
        batch, and a message that large is alone in its batch) and within the producer's own
        limit. The others would be refused, and with them the step at every run of the slice:
        they stay in the lake only, counted and named."""
        sizes = pc.fill_null(pc.add(pc.binary_length(texts), pc.fill_null(pc.binary_length(keys), 0)), 0)
        config = self.publishing.kafka_config
        most = producer_limit(config)  # a topic may allow more than the producer sends
        if (pc.max(sizes).as_py() or 0) <= min(limit, most):
            return None
        within = pc.less_equal(sizes, min(limit, most))
        fits = within.to_pylist()
        for i in pc.indices_nonzero(pc.invert(within)).to_pylist():
            key, size, value = keys[i].as_py(), sizes[i].as_py(), texts[i].as_py()
            value = value.encode() if isinstance(value, str) else value
            compressed = size - len(value) + compressed_size(value, config)
            fits[i] = size <= most and compressed <= limit
            if not fits[i]:
                self.undeliverable[table] = self.undeliverable.get(table, 0) + 1
                if len(self.examples) < EXAMPLES:
                    self.examples.append({"stream": stream.name, "key": key, "bytes": size, "compressed": compressed,
                                          "limit": limit})
        return None if all(fits) else pa.array(fits, pa.bool_())

    def undeliverable_report(self) -> list[dict]:
        """Report rows of the messages too large (see UNDELIVERABLE), with their counters' names."""
        return [{"table": UNDELIVERABLE, "path": "", "size": 0, "rows": 1, "stats": json.dumps(e)}
                for e in self.examples]

    def close(self) -> dict | None:
        """The report row of the spool written (see OUTBOX), None when nothing was sent."""
        if self.spool is None:
            return None
        self.spool.close()
        if self._memory is not None and (held := self._memory.held()) is not None:
            self.publishing.held[self.uri] = held
        return {"table": OUTBOX, "path": self.uri, "size": 0, "rows": self.spool.count,
                "stats": json.dumps({"tables": list(self.topics), "topics": [t for t, _ in self.topics.values()]})}


def replay_task(tasks: Iterator[dict], *, kafka_config: dict, storage_options,
                held: dict[str, pa.Buffer] | None = None) -> Iterator[dict]:
    """Produces the spools of each task ({"spools": [{"uri", "tables", "topics"}]}) and deletes them
    once every message is acknowledged; yields {"table", "count"} of what it published.

    `held`: spools kept in this process (see `Publishing`), taken from there instead of their files.
    """
    held = {} if held is None else held
    for task in tasks:
        producer, tables, replayed = BatchProducer(kafka_config), {}, []
        for spool in task["spools"]:
            tables.update(zip(spool["topics"], spool["tables"]))
            if spool["uri"] in held:
                replay_into(producer, pa.BufferReader(held[spool["uri"]]), spool["topics"])
                continue
            fs, path = filesystem(spool["uri"], storage_options)
            # buffered: the IPC reader's small reads would each be a request to an object store
            with fs.open_input_stream(path, buffer_size=SPOOL_READ_BUFFER) as source:
                replay_into(producer, source, spool["topics"])
            replayed.append((fs, path))
        counts = producer.close()
        for spool in task["spools"]:
            held.pop(spool["uri"], None)
        for fs, path in replayed:
            fs.delete_file(path)
        yield from ({"table": tables[topic], "count": n} for topic, n in counts.items())
