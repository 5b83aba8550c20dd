"""Ingest: Kafka records of a slice to validated rows and dead letters, inside Spark tasks.

Runs on the executors: each task reads its offset ranges with confluent-kafka, validates
every record against the seed's pydantic model and writes bounded parquet files; only the
file records travel back to the driver.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter

import pyarrow as pa
from pydantic import BaseModel

from entity_assets import adapters
from entity_assets import messages as m
from entity_assets.core import dumps
from entity_assets.kafka_io import read_range
from entity_assets.slices import OffsetRange
from entity_assets.storage import FileWriter
from entity_assets.tables import SCHEMAS

def _batch_values(b: m.EntityBatch) -> tuple:
    return (b.clientid, b.request, b.user, b.dbid, b.begun, len(b.patches), dumps(b.patches), b.learning,
            b.includeBefore, b.includeAfter)


def _schema_patch_values(p: m.SchemaPatch) -> tuple:
    return (p.clientid, p.request, p.user, p.dbid, p.parts, p.part, p.begun, dumps(p.ops), p.includeBefore,
            p.includeAfter)


def _ack_values(a: m.NotificationAck) -> tuple:
    return (a.dbid, a.user, a.device, a.begun, a.upTo,
            None if a.notifications is None else json.dumps(a.notifications))


@dataclass(frozen=True)
class InputStream:
    """A seed stream read from Kafka: its topic suffix, table and model, and its row's `fields`
    (the table's columns but the lineage) as `values` gives them for one record."""

    name: str
    table: str
    model: type[BaseModel]
    fields: tuple[str, ...]
    values: Callable[[BaseModel], tuple]

    def read(self, msg) -> tuple:
        """The row values of one Kafka message; InvalidMessage if it must go to dead letters."""
        return self.values(m.parse_message(self.model, msg.value()))


BATCH_FIELDS = ("clientid", "request", "user", "dbid", "begun", "parts", "patches", "learning", "includeBefore",
                "includeAfter")


@dataclass(frozen=True)
class IngestionStream:
    """A CDC ingestion topic (`adapters`): its records become `entity_batches` rows."""

    source: adapters.Source
    projection: str
    name: str = adapters.SUFFIX
    table: str = "entity_batches"
    fields: tuple[str, ...] = BATCH_FIELDS

    def read(self, msg) -> tuple:
        return adapters.batch_values(self.source, self.projection, msg.topic(), msg.partition(), msg.offset(),
                                     msg.timestamp()[1], msg.key(), msg.value())


_CONNECTION_FIELDS = ("clientid", "dbid", "user", "device", "appVersion", "begun")

INPUT_STREAMS: dict[str, InputStream] = {
    s.name: s
    for s in (
        InputStream("entity-batches", "entity_batches", m.EntityBatch, BATCH_FIELDS, _batch_values),
        InputStream("schema-patches", "schema_patches", m.SchemaPatch,
                    ("clientid", "request", "user", "dbid", "parts", "part", "begun", "ops", "includeBefore",
                     "includeAfter"), _schema_patch_values),
        InputStream("connections", "connections", m.Connection, _CONNECTION_FIELDS, attrgetter(*_CONNECTION_FIELDS)),
        InputStream("notification-acks", "notification_acks", m.NotificationAck,
                    ("dbid", "user", "device", "begun", "upTo", "notifications"), _ack_values),
    )
}

BATCH_ROWS = 20_000
"""Records of a range held as tuples before their one conversion to Arrow columns."""


class _Rows:
    """A range's valid records as they are read: their values and Kafka coordinates, turned
    into Arrow columns per `BATCH_ROWS` (no dict per record)."""

    def __init__(self, stream: InputStream | IngestionStream, r: OffsetRange, slice_key: str, out: FileWriter):
        self.stream, self.range, self.slice_key, self.out = stream, r, slice_key, out
        self.values: list[tuple] = []
        self.offsets: list[int] = []
        self.timestamps: list[int] = []

    def add(self, values: tuple, offset: int, timestamp: int) -> None:
        self.values.append(values)
        self.offsets.append(offset)
        self.timestamps.append(timestamp)
        if len(self.values) >= BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        n = len(self.values)
        if not n:
            return
        types = self.out.schema
        columns = {
            "slice": pa.repeat(pa.scalar(self.slice_key), n), "kafka_topic": pa.repeat(pa.scalar(self.range.topic), n),
            "kafka_partition": pa.repeat(pa.scalar(self.range.partition, pa.int32()), n),
            "kafka_offset": pa.array(self.offsets, pa.int64()), "kafka_timestamp": pa.array(self.timestamps, pa.int64()),
        }
        for name, values in zip(self.stream.fields, zip(*self.values)):
            columns[name] = pa.array(values, types.field(name).type)
        self.out.append_table(pa.table(columns))
        self.values, self.offsets, self.timestamps = [], [], []


def ingest_tasks(tasks: Iterator[dict], *, kafka_config: dict, streams_by_topic: dict[str, InputStream | IngestionStream],
                 slice_key: str, table_uris: dict[str, str], storage_options: dict | None,
                 max_rows_per_file: int = 250_000) -> Iterator[dict]:
    """mapPartitions body: yields one dict per data file written (see storage.DataFile)."""
    writers: dict[str, FileWriter] = {}

    def writer(table: str) -> FileWriter:
        if table not in writers:
            writers[table] = FileWriter(table, table_uris[table], SCHEMAS[table], slice_key,
                                        storage_options=storage_options, max_rows=max_rows_per_file)
        return writers[table]

    for task in tasks:
        r = OffsetRange(**task)
        stream = streams_by_topic[r.topic]
        rows, dead = _Rows(stream, r, slice_key, writer(stream.table)), writer("dead_letters")
        for msg in read_range(kafka_config, r):
            try:
                values = stream.read(msg)
            except Exception as exc:  # InvalidMessage: its code; anything else (a bug) must not lose the record either
                code, reason = ((exc.code.value, exc.reason) if isinstance(exc, m.InvalidMessage)
                                else (m.DeadLetterCode.UNEXPECTED.value, f"{type(exc).__name__}: {exc}"))
                dead.append({"slice": slice_key, "kafka_topic": r.topic, "kafka_partition": r.partition,
                             "kafka_offset": msg.offset(), "kafka_timestamp": msg.timestamp()[1], "stream": stream.name,
                             "kafka_key": msg.key(), "value": msg.value(), "code": code, "reason": reason})
                continue
            rows.add(values, msg.offset(), msg.timestamp()[1])
        rows.flush()
    for w in writers.values():
        for f in w.close():
            yield f.to_dict()
