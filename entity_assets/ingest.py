"""Ingest: Kafka records of a slice to validated rows and dead letters, inside Spark tasks.

Runs on the executors: each task reads its offset ranges with confluent-kafka, validates
every record against the seed's pydantic model and writes bounded parquet files; only the
file records travel back to the driver.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from operator import attrgetter

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from entity_assets import adapters, qlik
from entity_assets import messages as m
from entity_assets.kafka_io import RecordsExpired, read_range
from entity_assets.slices import OffsetRange, slice_key as slice_key_of, slice_seq
from entity_assets.storage import SLICE, FileWriter
from entity_assets.tables import SCHEMAS


def _batch_values(b: m.EntityBatch) -> tuple:
    return (b.clientid, b.request, b.user, b.dbid, b.begun, len(b.patches), m.value_json(b.patches), b.learning,
            b.includeBefore, b.includeAfter)


def _schema_patch_values(p: m.SchemaPatch) -> tuple:
    return (p.clientid, p.request, p.user, p.dbid, p.parts, p.part, p.begun, m.value_json(p.ops), p.includeBefore,
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
    may_hold_envelopes = False  # JSON records, never a Qlik envelope

    def read(self, msg) -> tuple:
        """The row values of one Kafka message; InvalidMessage if it must go to dead letters."""
        return self.values(m.parse_message(self.model, msg.value()))


BATCH_FIELDS = ("clientid", "request", "user", "dbid", "begun", "parts", "patches", "learning", "includeBefore",
                "includeAfter")


@dataclass(frozen=True)
class Routed:
    """Row values for another table than the stream's: a Qlik metadata message's `avro_schemas` row."""

    table: str
    values: tuple


ROUTED_FIELDS = {"avro_schemas": qlik.REGISTRY_FIELDS}


@dataclass(frozen=True)
class IngestionStream:
    """A CDC ingestion topic (`adapters`): its records become `entity_batches` rows.

    `registry`: the Qlik data schemas registered before the slice (`avro_schemas`).
    """

    source: adapters.Source
    projection: str
    registry: Mapping[str, qlik.Registered] = field(default_factory=dict, compare=False)
    name: str = adapters.SUFFIX
    table: str = "entity_batches"
    fields: tuple[str, ...] = BATCH_FIELDS

    @property
    def may_hold_envelopes(self) -> bool:
        return self.source.format in ("qlik", adapters.AUTO)

    @cached_property
    def _decoder(self) -> qlik.Decoder:
        return qlik.Decoder(dict(self.registry))

    def read(self, msg) -> tuple | Routed:
        return self.values_of(msg.topic(), msg.partition(), msg.offset(), msg.timestamp()[1], msg.key(), msg.value())

    def values_of(self, topic: str, partition: int, offset: int, timestamp: int, key: bytes | None,
                  value: bytes | None) -> tuple | Routed:
        values = adapters.batch_values(self.source, self.projection, topic, partition, offset, timestamp, key, value,
                                       self._decoder)
        if isinstance(values, qlik.Registered):  # the topic's later data messages decode at once (an id names one schema)
            self._decoder.registry.setdefault(values.schema_id, values)
            return Routed("avro_schemas", values.values(self.source.system))
        return values


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

    def __init__(self, fields: tuple[str, ...], r: OffsetRange, slice_key: str, out: FileWriter):
        self.fields, self.range, self.slice_key, self.out = fields, r, slice_key, out
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
        for name, values in zip(self.fields, zip(*self.values)):
            columns[name] = pa.array(values, types.field(name).type)
        self.out.append_table(pa.table(columns))
        self.values, self.offsets, self.timestamps = [], [], []


HELD = "held"
"""Data messages whose Qlik schema was unknown to the task: `schema_waits` files that the step
commits as they are, or rewrites (`resolve_tasks`) when the slice registers schemas or ends a wait."""

WAIT_STATS = ("slice", "schemaId")
"""Statistics of `schema_waits` files: a slice that registers schemas reads only the files whose
schema ids' range holds one of them."""


def lake_table(files: str) -> str:
    """The table that a task's files under `files` belong to (`HELD` files are `schema_waits` files)."""
    return "schema_waits" if files == HELD else files


def file_stats(table: str) -> tuple[str, ...]:
    """The columns whose statistics a data file of `table` (`lake_table`) records."""
    return WAIT_STATS if table == "schema_waits" else (SLICE,)


def record_size(key: bytes | None, value: bytes | None) -> int:
    return len(key or b"") + len(value or b"")


def dead_letter(out: FileWriter, exc: Exception, slice_key: str, stream: str, topic: str, partition: int,
                offset: int, timestamp: int, key: bytes | None, value: bytes | None,
                headers: list | None = None) -> None:
    """A `dead_letters` row of a record: an InvalidMessage's code, or GENERR009 for anything else (a
    bug); for a Qlik data message waiting for its schema, a `schema_waits` row, with the schema's id.
    `headers`: the record's, as confluent-kafka gives them ((key, value) pairs) or as a row holds them."""
    code, reason = ((exc.code.value, exc.reason) if isinstance(exc, m.InvalidMessage)
                    else (m.DeadLetterCode.UNEXPECTED.value, f"{type(exc).__name__}: {exc}"))
    kept = headers and [h if isinstance(h, dict) else {"key": h[0], "value": h[1]} for h in headers]
    out.append({"slice": slice_key, "kafka_topic": topic, "kafka_partition": partition, "kafka_offset": offset,
                "kafka_timestamp": timestamp, "stream": stream, "kafka_key": key, "value": value, "code": code,
                "reason": reason, "schemaId": exc.schema_id if isinstance(exc, qlik.SchemaPending) else None,
                "kafka_headers": kept or None},
               record_size(key, value) + sum(len(h["key"]) + len(h["value"] or b"") for h in kept or ()))


STAMPS_MODULUS = 2 ** 62
"""Tasks' sums of timestamps are taken modulo this (a long on the way to the driver), and so is the slice's."""


def ingest_tasks(tasks: Iterator[dict], *, kafka_config: dict, streams_by_topic: dict[str, InputStream | IngestionStream],
                 slice_key: str, table_uris: dict[str, str], storage_options: dict | None,
                 max_rows_per_file: int = 250_000) -> Iterator[dict]:
    """mapPartitions body: yields one dict per data file written (see storage.DataFile), the
    count of spans of offsets that Kafka no longer held (`COUNTER + "expired"`): each is an
    EA-EXPIRED dead letter, never a silent gap; of the records read (`COUNTER + "read"`),
    fewer than a compacted topic held at the slice's first run; and the sum of their Kafka
    timestamps (`COUNTER + "stamps"`), which tells other records at the same offsets (a topic
    created again and refilled as far) from those the slice read."""
    from entity_assets.fold import COUNTER

    writers: dict[str, FileWriter] = {}

    def writer(table: str) -> FileWriter:
        if table not in writers:
            target = lake_table(table)
            writers[table] = FileWriter(table, table_uris[target], SCHEMAS[target], slice_key,
                                        stats_columns=file_stats(target),
                                        storage_options=storage_options, max_rows=max_rows_per_file)
        return writers[table]

    expired = read = stamps = 0

    def lost(stream: str, gone: RecordsExpired) -> None:
        """One dead letter per span of offsets gone, at its first offset (no key, value or timestamp)."""
        nonlocal expired
        expired += 1
        dead_letter(writer("dead_letters"), m.InvalidMessage(m.DeadLetterCode.EXPIRED, str(gone)), slice_key, stream,
                    gone.topic, gone.partition, gone.start, -1, None, None)

    for task in tasks:
        r = OffsetRange(**task)
        stream = streams_by_topic[r.topic]
        rows = _Rows(stream.fields, r, slice_key, writer(stream.table))
        routed: dict[str, _Rows] = {}
        for msg in read_range(kafka_config, r, expired=partial(lost, stream.name)):
            read += 1
            stamps += msg.timestamp()[1]
            try:
                values = stream.read(msg)
            except Exception as exc:  # InvalidMessage: its code; anything else (a bug) must not lose the record either
                dead_letter(writer(HELD if isinstance(exc, qlik.SchemaPending) else "dead_letters"), exc, slice_key,
                            stream.name, r.topic, r.partition, msg.offset(), msg.timestamp()[1], msg.key(), msg.value(),
                            msg.headers())
                continue
            if type(values) is Routed:
                if values.table not in routed:
                    routed[values.table] = _Rows(ROUTED_FIELDS[values.table], r, slice_key, writer(values.table))
                routed[values.table].add(values.values, msg.offset(), msg.timestamp()[1])
                continue
            rows.add(values, msg.offset(), msg.timestamp()[1])
        for each in (rows, *routed.values()):
            each.flush()
    for w in writers.values():
        for f in w.close():
            yield f.to_dict()
    yield {"table": COUNTER + "expired", "path": "", "size": 0, "rows": expired, "stats": ""}
    yield {"table": COUNTER + "read", "path": "", "size": 0, "rows": read, "stats": ""}
    yield {"table": COUNTER + "stamps", "path": "", "size": 0, "rows": stamps % STAMPS_MODULUS, "stats": ""}


# --------------------------------------------------------------------------- Qlik data waiting for its schema

def registry_before(engine, slice_key: str) -> dict[str, qlik.Registered]:
    """The data schemas that metadata messages of the slices before `slice_key` registered (the
    first registration of an id wins: an id names one schema)."""
    if not engine.exists("avro_schemas"):
        return {}
    # Replicate sends a table's metadata again at each of its restarts: the ids first, then the
    # rows of each id's first registration only, not every repeat's schema text
    ids = engine.read("avro_schemas", columns=["slice", "schemaId"])
    ids = ids.filter(pc.less(ids.column("slice"), slice_key)).group_by("schemaId").aggregate([("slice", "min")])
    registry: dict[str, qlik.Registered] = {}
    for first in sorted(set(ids.column("slice_min").to_pylist())):
        rows = engine.read("avro_schemas", columns=["slice", *qlik.REGISTRY_FIELDS], where={"slice": first})
        for row in rows.to_pylist():
            registry.setdefault(row["schemaId"], qlik.Registered.from_row(row))
    return {schema_id: registry[schema_id] for schema_id in ids.column("schemaId").to_pylist()}


def ingestion_stream(topic: str, prefix: str, sources: Mapping[str, adapters.Source]) -> IngestionStream | None:
    """The stream of an ingestion topic, `<prefix><system>.<projection>.ingestion`, if `sources`
    (system, or `adapters.ANY_SYSTEM`, -> its settings) holds its system."""
    parsed = adapters.parse_topic(topic, prefix)
    source = parsed and (sources.get(parsed[0]) or sources.get(adapters.ANY_SYSTEM))
    if not source:
        return None
    return IngestionStream(replace(source, system=parsed[0]), projection=parsed[1])


WaitHistory = list[tuple[int, int]]
"""(first slice, schema_wait_slices) of each setting a lake's slices were first ingested with, in order."""


def wait_at(history: WaitHistory, seq: int) -> int:
    return next(wait for first, wait in reversed(history) if first <= seq)


def waits_ending(slice_key: str, history: WaitHistory) -> list[str]:
    """The slices whose waits for a schema end in `slice_key`: slice N - W's with the wait W of its
    time (itself with none; none for the first slices). Where the setting changed, those the slices
    before left, and none a slice before ended: a shorter wait ends several slices' at once, a
    longer one none until it has passed."""
    seq = slice_seq(slice_key)
    starts = [first for first, _ in history[1:]] + [seq]
    ended = max((min(end, seq) - 1 - wait for (first, wait), end in zip(history, starts) if first < seq), default=0)
    return [slice_key_of(k) for k in range(max(ended, 0) + 1, seq - wait_at(history, seq) + 1)]


def waits_for(f, schema_ids) -> bool:
    """Whether a `schema_waits` file may hold waits for one of `schema_ids`, by its statistics."""
    return any(f.min["schemaId"] <= s <= f.max["schemaId"] for s in schema_ids)


def new_registrations(engine, files: dict[str, list], registry: Mapping[str, qlik.Registered]) -> dict:
    """The schemas that the slice's metadata messages (its `avro_schemas` files) register for the first time."""
    from entity_assets.storage import read_table

    new: dict[str, qlik.Registered] = {}
    for f in files.get("avro_schemas", []):
        for row in read_table(f"{engine.uri('avro_schemas')}/{f.path}", engine.storage_options).to_pylist():
            if row["schemaId"] not in registry:
                new.setdefault(row["schemaId"], qlik.Registered.from_row(row))
    return new


def resolve_tasks(tasks: Iterator[dict], *, prefix: str, sources: Mapping[str, adapters.Source],
                  registry: Mapping[str, qlik.Registered], new: frozenset[str], slice_key: str, due: frozenset[str],
                  table_uris: dict[str, str], storage_options: dict | None) -> Iterator[dict]:
    """mapPartitions body: the Qlik data messages waiting for their schema (`schema_waits` rows).

    A task reads its `files` of waits: the slice's held ones (`HELD`) or, for `earlier`, committed
    ones of slices before it. A message whose schema is `new` (the slice registers it) becomes an
    `entity_batches` row of this slice with its own Kafka coordinates (or a dead letter of another
    code if it is bad otherwise); a held one that still waits is a `schema_waits` row of the slice.
    One read in a slice whose waits end in this one (`due`, `waits_ending`) whose schema no slice
    has registered is an EA-SCHEMA-UNKNOWN dead letter of this slice; it keeps its `schema_waits` row, so the slice that
    registers its schema, whenever it comes, still applies it. `registry`: every schema known,
    `new` ones included. Yields the files written, and one record per message applied under the
    table `COUNTER + "applied"`.
    """
    from entity_assets.fold import COUNTER
    from entity_assets.storage import read_table, to_rows

    def writer(table: str) -> FileWriter:
        return FileWriter(table, table_uris[table], SCHEMAS[table], slice_key, storage_options=storage_options,
                          stats_columns=file_stats(table))

    batches, dead, waits = writer("entity_batches"), writer("dead_letters"), writer("schema_waits")
    streams: dict[str, IngestionStream | None] = {}
    rows: dict[tuple[str, int], _Rows] = {}  # applied messages by topic and partition, as `ingest_tasks` writes them
    applied = 0
    for task in tasks:
        for r in (r for f in task["files"] for r in to_rows(read_table(f, storage_options))):
            if task["earlier"] and r["slice"] >= slice_key:
                continue
            topic, schema_id = r["kafka_topic"], r["schemaId"]
            if topic not in streams:
                stream = ingestion_stream(topic, prefix, sources)
                streams[topic] = stream and replace(stream, registry=registry)
            stream = streams[topic]
            if stream is None or schema_id not in new:
                if not task["earlier"]:
                    waits.append(r, record_size(r["kafka_key"], r["value"]))
                if r["slice"] in due and schema_id not in registry:
                    waited = slice_seq(slice_key) - slice_seq(r["slice"])
                    reason = (f"no metadata message registered schema {schema_id} in the {waited} slice(s) from "
                              f"slice {r['slice']}, which read this data message; the slice that registers it applies it")
                    dead.append({**r, "slice": slice_key, "code": m.DeadLetterCode.SCHEMA_UNKNOWN.value,
                                 "reason": reason}, record_size(r["kafka_key"], r["value"]))
                continue
            coordinates = (topic, r["kafka_partition"], r["kafka_offset"], r["kafka_timestamp"])
            try:
                values = stream.values_of(*coordinates, r["kafka_key"], r["value"])
            except Exception as exc:
                dead_letter(dead, exc, slice_key, r["stream"], *coordinates, r["kafka_key"], r["value"],
                            r.get("kafka_headers"))
                continue
            if (topic, coordinates[1]) not in rows:
                rows[topic, coordinates[1]] = _Rows(BATCH_FIELDS, OffsetRange(topic, coordinates[1], 0, 0), slice_key,
                                                    batches)
            rows[topic, coordinates[1]].add(values, r["kafka_offset"], r["kafka_timestamp"])
            applied += 1
    for each in rows.values():
        each.flush()
    for f in (*batches.close(), *dead.close(), *waits.close()):
        yield f.to_dict()
    yield {"table": COUNTER + "applied", "path": "", "size": 0, "rows": applied, "stats": ""}
