"""Ingest: Kafka records of a slice to validated rows and dead letters, inside Spark tasks.

Runs on the executors: each task reads its offset ranges with confluent-kafka, validates
every record against the seed's pydantic model and writes bounded parquet files; only the
file records travel back to the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pydantic import BaseModel

from entity_assets import messages as m
from entity_assets.core import dumps
from entity_assets.kafka_io import read_range
from entity_assets.slices import OffsetRange
from entity_assets.storage import FileWriter
from entity_assets.tables import SCHEMAS

def _batch_row(b: m.EntityBatch) -> dict:
    return {
        "clientid": b.clientid, "request": b.request, "user": b.user, "dbid": b.dbid, "begun": b.begun,
        "parts": len(b.patches), "patches": dumps(b.patches),
        "learning": b.learning, "includeBefore": b.includeBefore, "includeAfter": b.includeAfter,
    }


def _schema_patch_row(p: m.SchemaPatch) -> dict:
    return {
        "clientid": p.clientid, "request": p.request, "user": p.user, "dbid": p.dbid, "parts": p.parts,
        "part": p.part, "begun": p.begun, "ops": dumps(p.ops),
        "includeBefore": p.includeBefore, "includeAfter": p.includeAfter,
    }


def _connection_row(c: m.Connection) -> dict:
    return c.model_dump(include={"clientid", "dbid", "user", "device", "appVersion", "begun"})


def _ack_row(a: m.NotificationAck) -> dict:
    import json

    return {
        "dbid": a.dbid, "user": a.user, "device": a.device, "begun": a.begun, "upTo": a.upTo,
        "notifications": None if a.notifications is None else json.dumps(a.notifications),
    }


@dataclass(frozen=True)
class InputStream:
    """A seed stream read from Kafka: its topic suffix, table, model and row mapping."""

    name: str
    table: str
    model: type[BaseModel]
    to_row: Callable[[BaseModel], dict]


INPUT_STREAMS: dict[str, InputStream] = {
    s.name: s
    for s in (
        InputStream("entity-batches", "entity_batches", m.EntityBatch, _batch_row),
        InputStream("schema-patches", "schema_patches", m.SchemaPatch, _schema_patch_row),
        InputStream("connections", "connections", m.Connection, _connection_row),
        InputStream("notification-acks", "notification_acks", m.NotificationAck, _ack_row),
    )
}


def ingest_tasks(tasks: Iterator[dict], *, kafka_config: dict, streams_by_topic: dict[str, str],
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
        stream = INPUT_STREAMS[streams_by_topic[r.topic]]
        out, dead = writer(stream.table), writer("dead_letters")
        for msg in read_range(kafka_config, r):
            value = msg.value()
            lineage = {
                "slice": slice_key, "kafka_topic": r.topic, "kafka_partition": r.partition,
                "kafka_offset": msg.offset(), "kafka_timestamp": msg.timestamp()[1],
            }
            try:
                row = stream.to_row(m.parse_message(stream.model, value))
            except m.InvalidMessage as exc:
                dead.append({**lineage, "stream": stream.name, "kafka_key": msg.key(), "value": value,
                             "code": exc.code.value, "reason": exc.reason})
                continue
            except Exception as exc:  # a bug must not lose the record either
                dead.append({**lineage, "stream": stream.name, "kafka_key": msg.key(), "value": value,
                             "code": m.DeadLetterCode.UNEXPECTED.value, "reason": f"{type(exc).__name__}: {exc}"})
                continue
            row.update(lineage)
            out.append(row)
    for w in writers.values():
        for f in w.close():
            yield f.to_dict()
