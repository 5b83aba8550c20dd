"""Arrow schemas of every lake table: one place, one name per stream.

Column names are the seed's field names. Nested documents (ops, patches, before, after,
responses) are JSON text: Delta, Spark and every consumer read them without a schema per
collection. Every table carries the slice key; stream tables also carry the Kafka
coordinates of the source record for lineage and dedupe.
"""

from __future__ import annotations

import pyarrow as pa

STR, I32, I64, BOOL, BIN = pa.string(), pa.int32(), pa.int64(), pa.bool_(), pa.binary()

LINEAGE = [
    ("slice", STR),
    ("kafka_topic", STR),
    ("kafka_partition", I32),
    ("kafka_offset", I64),
    ("kafka_timestamp", I64),
]
REQUEST = [("clientid", STR), ("request", I64), ("user", STR), ("dbid", STR)]
FLAGS = [("learning", BOOL), ("includeBefore", BOOL), ("includeAfter", BOOL)]
TARGET = [("collection", STR), ("zone", STR), ("entity", STR)]
RESULT = [("ended", I64), ("status", I32), ("error", STR), ("before", STR), ("after", STR)]


def _schema(*groups) -> pa.Schema:
    return pa.schema([field for group in groups for field in group])


SCHEMAS: dict[str, pa.Schema] = {
    # inputs, one row per valid Kafka record
    "entity_batches": _schema(LINEAGE, REQUEST, [("begun", I64), ("parts", I32), ("patches", STR)], FLAGS),
    "schema_patches": _schema(
        LINEAGE, REQUEST, [("parts", I32), ("part", I32), ("begun", I64), ("ops", STR)], FLAGS[1:]
    ),
    "connections": _schema(
        LINEAGE, [("clientid", STR), ("dbid", STR), ("user", STR), ("device", STR), ("appVersion", STR), ("begun", I64)]
    ),
    "notification_acks": _schema(
        LINEAGE, [("dbid", STR), ("user", STR), ("device", STR), ("notifications", STR), ("upTo", I64), ("begun", I64)]
    ),
    "dead_letters": _schema(
        LINEAGE,
        [("stream", STR), ("kafka_key", BIN), ("value", BIN), ("code", STR), ("reason", STR)],
    ),
    # the entity core
    "entity_patches": _schema(
        LINEAGE, REQUEST, TARGET, [("parts", I32), ("part", I32), ("begun", I64), ("ops", STR)], FLAGS, [("bucket", I32)]
    ),
    "entity_updates": _schema(
        LINEAGE, REQUEST, TARGET, [("parts", I32), ("part", I32), ("begun", I64), ("ops", STR)], FLAGS, RESULT
    ),
    "entities": _schema(
        [("slice", STR)], [("dbid", STR)], TARGET,
        [("version", I64), ("deleted", BOOL), ("document", STR), ("ended", I64), ("bucket", I32)],
    ),
    "complete_responses": _schema(
        LINEAGE, REQUEST, [("parts", I32), ("begun", I64), ("ended", I64), ("responses", STR)]
    ),
}
# Partial responses carry the structure of entity-updates and schema-updates (the seed), so
# schema results (no collection/zone/entity) share the table; `stream` says which.
SCHEMAS["partial_responses"] = pa.schema(list(SCHEMAS["entity_updates"]) + [pa.field("stream", STR)])
SCHEMAS["pending_responses"] = SCHEMAS["partial_responses"]

INPUT_TABLES = ("entity_batches", "schema_patches", "connections", "notification_acks")
