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
COORDINATES = ("kafka_topic", "kafka_partition", "kafka_offset")
"""A record's place in Kafka: a redelivery is a row at coordinates other than its first delivery's."""
REQUEST = [("clientid", STR), ("request", I64), ("user", STR), ("dbid", STR)]
FLAGS = [("learning", BOOL), ("includeBefore", BOOL), ("includeAfter", BOOL)]
TARGET = [("collection", STR), ("zone", STR), ("entity", STR)]
RESULT = [("ended", I64), ("status", I32), ("error", STR), ("before", STR), ("after", STR)]
HEADERS = pa.list_(pa.struct([("key", STR), ("value", BIN)]))
"""A record's Kafka headers, in order, as Spark's Kafka source reads them (a repeated key stays)."""
LETTER = [("stream", STR), ("kafka_key", BIN), ("value", BIN), ("code", STR), ("reason", STR),
          ("kafka_headers", HEADERS)]
STATE = [("version", I64), ("deleted", BOOL), ("document", STR), ("ended", I64), ("bucket", I32)]


def _schema(*groups) -> pa.Schema:
    return pa.schema([field for group in groups for field in group])


UPDATE = _schema(
    LINEAGE, REQUEST, TARGET, [("parts", I32), ("part", I32), ("begun", I64), ("ops", STR)], FLAGS, RESULT,
    [("action", STR), ("subjectZone", STR)],
)
"""The seed's entity-updates structure, with two derived columns for the notification streams
that are not part of the published message: action (created/updated/deleted) and subjectZone
(the zone-changes partition)."""


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
    # schemas that Qlik Replicate metadata messages registered (docs/ingestion.md)
    "avro_schemas": _schema(
        LINEAGE, [("system", STR), ("schemaId", STR), ("table", STR), ("primaryKey", STR), ("dataSchema", STR)]
    ),
    "dead_letters": _schema(LINEAGE, LETTER),
    # Qlik data messages read before their schema's metadata message: a dead letter and its schema id
    "schema_waits": _schema(LINEAGE, LETTER, [("schemaId", STR)]),
    # the entity core
    "entity_patches": _schema(
        LINEAGE, REQUEST, TARGET, [("parts", I32), ("part", I32), ("begun", I64), ("ops", STR)], FLAGS, [("bucket", I32)]
    ),
    # an index of each entity's updates (history.py): bucket, the entity's state bucket,
    # non-decreasing in each file (a fold task writes its buckets in order), so that row-group
    # statistics find an entity in a file; previousSlice, the slice of its update before this
    # slice's (null for its first), so that a history reads only the slices that changed it
    # leftZone: the zone a $zoneSubscription moved away from, whose zone_changes partition hears of it too
    "entity_updates": pa.schema(list(UPDATE) + [pa.field("bucket", I32), pa.field("previousSlice", STR),
                                                pa.field("leftZone", STR)]),
    "entities": _schema([("slice", STR), ("dbid", STR)], TARGET, STATE),
    "schema_updates": _schema(
        LINEAGE, REQUEST, [("parts", I32), ("part", I32), ("begun", I64), ("ops", STR)], FLAGS[1:], RESULT
    ),
    "schemas": _schema([("slice", STR), ("dbid", STR)], STATE),
    # entity rows (kind "entity", the entity-updates shape with `after` always set) and
    # entity-type rows (kind "entity-type": collection is the type, `after` that type only)
    "schema_learning": _schema(
        LINEAGE, REQUEST, TARGET, [("parts", I32), ("part", I32), ("begun", I64), ("ops", STR)], FLAGS,
        [("ended", I64), ("status", I32), ("before", STR), ("after", STR), ("kind", STR)],
    ),
    "learned_schemas": _schema(
        [("slice", STR), ("dbid", STR), ("collection", STR), ("observed", I64), ("declared", STR),
         ("learned", STR), ("summary", STR), ("disagreements", STR)]
    ),
    "devices": _schema(
        [("slice", STR), ("dbid", STR), ("user", STR), ("device", STR), ("clientid", STR), ("appVersion", STR),
         ("firstSeen", I64), ("lastSeen", I64), ("connections", I64), ("bucket", I32)]
    ),
    "zone_changes": UPDATE,  # the entity-updates structure (the seed)
    # bucket: the device's device_inboxes bucket; clientid, request, part and begun: the change's
    # request, by which device_notifications publishes a device's summaries in the fold's order
    "changes_by_device": _schema(
        LINEAGE, [("dbid", STR)], TARGET,
        [("notification", STR), ("action", STR), ("ended", I64), ("device", STR), ("user", STR)],
        [("bucket", I32), ("clientid", STR), ("request", I64), ("part", I32), ("begun", I64)],
    ),
    "device_notifications": _schema(
        [("slice", STR), ("dbid", STR), ("user", STR), ("device", STR), ("count", I64), ("begun", I64), ("ended", I64)]
    ),
    "device_inboxes": _schema(
        [("slice", STR), ("dbid", STR), ("user", STR), ("device", STR), ("version", I64), ("deleted", BOOL),
         ("document", STR), ("ended", I64), ("bucket", I32)]
    ),
    "complete_responses": _schema(
        LINEAGE, REQUEST, [("parts", I32), ("begun", I64), ("ended", I64), ("responses", STR)]
    ),
}
# Partial responses carry the structure of entity-updates and schema-updates (the seed), so
# schema results (no collection/zone/entity) share the table; `stream` says which.
SCHEMAS["partial_responses"] = pa.schema(list(UPDATE) + [pa.field("stream", STR)])
SCHEMAS["pending_responses"] = SCHEMAS["partial_responses"]

ADDED_IN_PLACE = {"entity_updates": ("bucket", "previousSlice", "leftZone"),
                  "changes_by_device": ("clientid", "request", "part", "begun"),
                  "dead_letters": ("kafka_headers",), "schema_waits": ("kafka_headers",)}
"""Columns that a table of an older release gains by a metadata commit (`DeltaRsEngine.ensure`),
its older files reading as null there, instead of a rebuild (docs/operations.md, Upgrading):
only columns whose readers take null for "nothing to do", such as an index."""

APPLIED_IN_ORDER = ("entities", "schemas", "pending_responses", "learned_schemas", "devices", "device_inboxes")
"""The state tables: each applies slices strictly in order and records the last in a Delta app
transaction (`assets.common.commit_state`); the newest of them is the last slice the lake holds
(`sensors.lake_holds`)."""

INPUT_TABLES = ("entity_batches", "schema_patches", "connections", "notification_acks")
