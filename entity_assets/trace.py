"""Row-level lineage: where one input record went, table by table, down to each notified device's inbox
and the state its rows changed (entities, schemas, devices) as it is now.

Every row derived from an input record keeps the record's Kafka coordinates (`tables.LINEAGE`),
and each file of a table holds the rows of one slice. So a record's trail is read from the files
of the one slice whose offset range holds it (`slice_manifests`), filtered by those coordinates
in the parquet statistics: no other slice is read, however old the lake.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field

import pyarrow as pa

from entity_assets import core
from entity_assets.fold import key_buckets
from entity_assets.kafka_io import RecordsExpired
from entity_assets.manifests import TABLE as MANIFESTS
from entity_assets.manifests import ManifestStore
from entity_assets.messages import DeadLetterCode
from entity_assets.notify import DEVICE_KEY, DeviceInbox
from entity_assets.slices import OffsetRange, slice_key
from entity_assets.storage import DeltaRsEngine, read_tables
from entity_assets.tables import LINEAGE

TRAIL = ("entity_batches", "schema_patches", "connections", "notification_acks", "avro_schemas", "dead_letters",
         "schema_waits", "entity_patches", "entity_updates", "schema_updates", "schema_learning", "partial_responses",
         "complete_responses", "zone_changes", "changes_by_device")
"""The tables whose rows carry the coordinates of the input record they came from, in the graph's order."""
RECORD_TABLES = 7
"""The first tables of `TRAIL`: the record's own row, its dead letter, or its wait for a schema."""

STATES = {
    "entities": ("entity_patches", core.ENTITY_KEY),
    "schemas": ("schema_patches", ("dbid",)),
    "devices": ("connections", DEVICE_KEY),
    "device_inboxes": ("notification_acks", ("device",)),
}
"""State table -> the trail's table whose rows name its keys, and the key columns."""

EXPIRED = DeadLetterCode.EXPIRED.value

_HIDDEN = {name for name, _ in LINEAGE} | {"bucket"}
"""Columns a trail leaves out of its rows: the coordinates it was asked for, and storage layout."""


@dataclass
class Trail:
    topic: str
    partition: int
    offset: int
    slice: str | None = None
    applied: str | None = None
    """The later slice that applied the record, for a Qlik data message that waited for its schema
    (a `schema_waits` row of its own slice); None otherwise."""
    rows: dict[str, list[dict]] = field(default_factory=dict)
    """Table -> the record's rows in it (tables without any are left out)."""
    inboxes: list[dict] = field(default_factory=list)
    """Per device the record notified: its count after the record's slice, its count now, and
    which of the record's notifications are still unacknowledged (not acknowledged, nor let
    expire by an inbox past notify.MAX_PENDING)."""
    states: dict[str, list[dict]] = field(default_factory=dict)
    """State table -> the rows, as they are now, of the keys the record's rows name (`STATES`): the
    entities its patches targeted, its schema patch's database, its connection's device. A row's
    `slice` is the last one that changed it."""
    notes: list[str] = field(default_factory=list)
    """Why the trail stops where it does: a repeat left out, a slice not run (yet), an offset that holds no record."""


def parse_record(text: str, topic_of) -> tuple[str, int, int]:
    """TOPIC:PARTITION:OFFSET (a topic name may hold colons, the numbers cannot); `topic_of`
    gives the topic of the name (`KafkaResource.topic_named`: the prefix where it lacks it)."""
    topic, partition, offset = (text.rsplit(":", 2) + ["", ""])[:3]
    # ASCII digits: `str.isdigit` also takes ², which `int` refuses, and ١٢, which it reads as 12
    if not (topic and all(n.isascii() and n.isdigit() for n in (partition, offset))):
        raise ValueError(f"{text!r} is not TOPIC:PARTITION:OFFSET (e.g. entity-batches:0:17)")
    return topic_of(topic), int(partition), int(offset)


def slice_holding(engine: DeltaRsEngine, topic: str, partition: int, offset: int) -> str | None:
    """The slice whose offset range holds the record; None before the sensor closed one over it.

    A partition's offsets only grow from slice to slice, so a binary search over the slices
    reads ~log2(slices) manifests (slice_manifests has a file per slice, each naming every
    partition, idle ones too, so their offset statistics do not narrow it). Where a topic's
    offsets went back and were read again (`offsets_went_back="restart"`), they do not grow:
    the manifests that can hold the offset are read then, for an offset below the newest
    slice's end (past it, a record of the topic's first life is not found), and so they are for
    a partition the newest slice does not name (its topic deleted since)."""
    if not engine.exists(MANIFESTS):
        return None
    store = ManifestStore(engine, reading=True)

    @functools.cache  # the search's last slice is often one it read already
    def range_of(seq: int) -> OffsetRange | None:
        return next((r for r in store.get(seq).ranges if (r.topic, r.partition) == (topic, partition)), None)

    low, high = 1, store.latest_seq()
    newest = range_of(high) if high else None
    if newest is not None:
        if offset >= newest.end:
            return None  # past every slice
        while low < high:  # the first slice whose range of the partition ends past the offset
            middle = (low + high) // 2
            found = range_of(middle)
            low, high = (middle + 1, high) if found is None or found.end <= offset else (low, middle)
        if (found := range_of(low)) is not None and found.start <= offset < found.end:
            return slice_key(low)
    # offsets read again, or a partition the newest slice does not name (its topic deleted since)
    files = [f for f in engine.files(MANIFESTS)
             if f.min.get("start_offset", offset) <= offset < f.max.get("end_offset", offset + 1)]
    at = [("topic", "=", topic), ("partition", "=", partition), ("start_offset", "<=", offset), ("end_offset", ">", offset)]
    hit = [s for t in read_tables(files, engine.storage_options, ["slice"], at) for s in t.column("slice").to_pylist()]
    return hit[0] if hit else None


def trace(engine: DeltaRsEngine, topic: str, partition: int, offset: int) -> Trail:
    trail = Trail(topic, partition, offset, slice_holding(engine, topic, partition, offset))
    if trail.slice is None:
        return trail
    at = [("kafka_topic", "=", topic), ("kafka_partition", "=", partition), ("kafka_offset", "=", offset)]
    for table in TRAIL[:RECORD_TABLES]:
        _add(trail, table, _read(engine, table, [trail.slice], None, at))
    if not trail.rows:  # gone from Kafka before its slice read it: the dead letter of its span
        gone = [("kafka_topic", "=", topic), ("kafka_partition", "=", partition), ("kafka_offset", "<=", offset),
                ("code", "=", EXPIRED)]
        _add(trail, "dead_letters", [r for r in _read(engine, "dead_letters", [trail.slice], None, gone)
                                     if offset in (RecordsExpired.span(r["reason"]) or ())])
    if "schema_waits" in trail.rows:  # every slice's files: a rare path
        # of a later slice: offsets read again after a restart are another record's in earlier ones
        after = [("slice", ">", trail.slice), *at]
        later = sorted(_read(engine, "entity_batches", None, None, after), key=lambda r: r["slice"])[:1]
        trail.applied = later[0]["slice"] if later else None
        _add(trail, "entity_batches", later)
        # the wait's end, or the record bad once decoded: after its own slice's, in slice order
        _add(trail, "dead_letters", sorted(_read(engine, "dead_letters", None, None, after), key=lambda r: r["slice"]))
    for table in TRAIL[RECORD_TABLES:]:
        _add(trail, table, _read(engine, table, [trail.applied or trail.slice], None, at))
    trail.inboxes = _inboxes(engine, trail.applied or trail.slice, trail.rows.get("changes_by_device", []))
    for table, (source, key) in STATES.items():
        found = _state(engine, table, key, {tuple(r[c] for c in key) for r in trail.rows.get(source, [])})
        if table == "device_inboxes":  # an ack's device: its unacknowledged count now
            found = [{**r, "count": DeviceInbox.from_json(r["document"]).count} for r in found if not r["deleted"]]
        if found:
            trail.states[table] = found
    trail.notes = _notes(engine, trail)
    return trail


LEFT_OUT = {"entity_batches": ("entity_patches", core.BATCH_IDENTITY),
            "schema_patches": ("schema_updates", core.SCHEMA_PATCH_IDENTITY)}
"""An input table whose repeats a step leaves out: the table the others reach, and the identity."""
STEP_AFTER = {"entity_patches": "partial_responses", "entity_updates": "zone_changes"}
"""A trail's table, and one that the next step writes a row of for each of its rows."""


def _notes(engine: DeltaRsEngine, trail: Trail) -> list[str]:
    at = trail.applied or trail.slice
    if not trail.rows:
        if engine.exists("entity_batches") and engine.reached("entity_batches", trail.slice, "replace_slice"):
            return ["its slice was ingested, and no record of it holds this offset (a compacted topic's gap, a "
                    "transaction's marker)"]
        return ["no row of this record in the slice's tables: its slice has not run yet"]
    for source, (reached, identity) in LEFT_OUT.items():
        if source in trail.rows and reached not in trail.rows:
            if engine.exists(reached) and engine.reached(reached, at, "replace_slice"):
                return [f"left out of {reached}: its {', '.join(identity)} came before, in the slice or its dedupe window "
                        "(a redelivery; with another `begun`, the id used again, which the request_ids_not_reused "
                        "check names)"]
            return [f"{reached}: its slice's step has not run yet"]
    for have, then in STEP_AFTER.items():
        if have in trail.rows and then not in trail.rows and not (
                engine.exists(then) and engine.reached(then, at, "replace_slice")):
            return [f"{then}: its slice's step has not run yet"]
    return []


def _add(trail: Trail, table: str, rows: list[dict]) -> None:
    """Appends: a held record may have rows of a table in its own slice and in a later one (a
    dead letter of its wait, then one of the record once decoded)."""
    if rows:
        trail.rows.setdefault(table, []).extend(_shown(row) for row in rows)


def _read(engine: DeltaRsEngine, table: str, slices: list[str] | None, columns: list[str] | None, filters) -> list[dict]:
    """The rows of `table` (of `slices`' files, or of its latest version) that `filters` keep;
    row groups whose statistics exclude them are not decoded."""
    if not engine.exists(table):
        return []
    files = engine.files(table) if slices is None else engine.slice_files(table, slices)
    return [row for t in read_tables(files, engine.storage_options, columns, filters) for row in t.to_pylist()]


def _shown(row: dict) -> dict:
    return {k: _text(v) for k, v in row.items() if k not in _HIDDEN}


def _text(value):
    """Bytes (a key, a value, a header's value) as text, for people and JSON."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list):
        return [_text(v) for v in value]
    return {k: _text(v) for k, v in value.items()} if isinstance(value, dict) else value


def _inboxes(engine: DeltaRsEngine, slice_key: str, changes: list[dict]) -> list[dict]:
    """The notified devices' counts after the slice (device_notifications) and now (device_inboxes)."""
    mine: dict[str, list[str]] = {}
    for change in changes:
        mine.setdefault(change["device"], []).append(change["notification"])
    if not mine:
        return []
    devices = [("device", "in", sorted(mine))]
    then = {r["device"]: r["count"] for r in _read(engine, "device_notifications", [slice_key], ["device", "count"], devices)}
    now = {r["device"]: DeviceInbox.from_json(r["document"])  # the files of their buckets only
           for r in _state(engine, "device_inboxes", ("device",), {(d,) for d in mine}) if not r["deleted"]}
    return [{"device": device, "notifications": ids, "count_after_slice": then.get(device),
             "count_now": now[device].count if device in now else None,
             "unacknowledged": [n for n in ids if device in now and n in now[device].pending]}
            for device, ids in sorted(mine.items())]


def _state(engine: DeltaRsEngine, table: str, key: tuple[str, ...], keys: set[tuple]) -> list[dict]:
    """The current rows of `keys` in a bucketed state table, without their bucket, in key order."""
    if not keys:
        return []
    buckets = key_buckets(pa.table({c: [k[i] for k in keys] for i, c in enumerate(key)}), key).to_pylist()
    found = engine.state_rows(table, key, keys, buckets)
    return sorted(({k: v for k, v in r.items() if k != "bucket"} for r in found), key=lambda r: [r[c] for c in key])


_SUMMARY = {
    "entity_batches": ("clientid", "request", "user", "dbid", "parts"),
    "schema_patches": ("clientid", "request", "dbid", "part", "parts"),
    "connections": ("dbid", "user", "device", "appVersion"),
    "notification_acks": ("dbid", "user", "device", "notifications", "upTo"),
    "avro_schemas": ("system", "schemaId", "table", "primaryKey"),
    "dead_letters": ("stream", "code", "reason"),
    "schema_waits": ("stream", "code", "reason"),
    "entity_patches": ("part", "parts", "collection", "zone", "entity"),
    "entity_updates": ("part", "collection", "zone", "entity", "action"),
    "schema_updates": ("part", "status", "error"),
    "schema_learning": ("kind", "collection", "entity"),
    "partial_responses": ("part", "status", "error"),
    "complete_responses": ("parts",),
    "zone_changes": ("subjectZone", "entity", "action"),
    "changes_by_device": ("device", "action", "notification"),
    # states, as they are now
    "entities": ("collection", "zone", "entity", "version", "deleted", "slice", "document"),
    "schemas": ("dbid", "version", "slice", "document"),
    "devices": ("user", "device", "appVersion", "firstSeen", "lastSeen", "connections", "slice"),
    "device_inboxes": ("device", "user", "count", "ended", "slice"),
}


def format_trail(trail: Trail, shown: int | None = None) -> str:
    """The trail as text: a line per row, per state row as it is now, and per notified device;
    `shown`: at most that many lines of each table (a batch of thousands of entities in a zone
    many devices watch reaches hundreds of thousands of rows), and a line saying how many more."""
    head = f"{trail.topic}:{trail.partition}:{trail.offset}"
    if trail.slice is None:
        return (f"{head}: in no slice (the sensor has not closed one over this offset yet, or the topic has no "
                "such partition or offset)")
    lines = [f"{head}: slice {trail.slice}" + (f", applied in slice {trail.applied} (it waited for its schema)"
                                                if trail.applied else "")]
    width = len("device_notifications")  # the longest name of a line

    def listed(table: str, found: list, line) -> list[str]:
        more = len(found) - shown if shown is not None and len(found) > shown else 0
        return [f"  {table:<{width}}  {line(row)}" for row in found[:len(found) - more]] + (
            [f"  {table:<{width}}  ... {more} more (entity-assets trace lists them all)"] if more else [])

    for table, found in trail.rows.items():
        lines += listed(table, found, lambda row: _fields(row, _SUMMARY[table]))
    lines += [f"  {note}" for note in trail.notes]
    for table, found in trail.states.items():
        lines += listed(table, found, lambda row: f"now: {_fields(row, _SUMMARY[table])}")
    lines += listed("device_notifications", trail.inboxes, lambda inbox: (
        f"device={inbox['device']} count after the slice={inbox['count_after_slice']} now={inbox['count_now']} "
        f"unacknowledged={len(inbox['unacknowledged'])} of {len(inbox['notifications'])}"))
    return "\n".join(map(printable, lines))


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """Client text for a terminal or a log: control characters (a line break, which would fake a
    line; ESC, which would drive the terminal) and bidirectional overrides as `\\uXXXX`, the
    escapes JSON text also takes."""
    return _UNPRINTABLE.sub(lambda c: f"\\u{ord(c.group()):04x}", text)


def _fields(row: dict, names: tuple[str, ...]) -> str:
    return " ".join(f"{k}={_short(row[k])}" for k in names if row.get(k) is not None and row[k] is not False)


def _short(value, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
