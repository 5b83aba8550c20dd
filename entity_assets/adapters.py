"""Ingestion adapters: change-data-capture records (seeds 001 and 000) become entity batches.

A source database's CDC connector writes one topic per projection (a table), named
`<tenant>.<environment>.<source-system>.<projection>.ingestion`. A record's key is the row's
primary key and its value the change, in one of four formats: IBM InfoSphere Data Replication
for DB2 (the whole row, or null for a delete), Oracle GoldenGate (`op_type` I/U/D with `before`
and `after`), Debezium (`op` c/r/u/d with `before`, `after` and `source`; its MongoDB connector's
documents are MongoDB Extended JSON text), or Qlik Replicate's
Avro envelope (`qlik`: data messages decoded with the schemas its metadata messages register;
the primary key comes from the metadata).

Each record becomes an entity batch, the row a client's batch would give, so it takes
the native path from `entity_batches` on (patches, updates, state, responses, zone changes):
- entity: the primary key's values joined by underscores, GoldenGate's own key form, so a
  projection gets the same ids whichever connector feeds it;
- collection: the projection, or with the source's `collection="table"` the table the record
  names (topics that carry several tables); zone and dbid: the source's (by default its system name);
- ops: an insert, update, upsert or snapshot read replaces the whole document
  (`add` at `""`, which also creates it); a delete, or a record without a value (a tombstone),
  deletes the entity (`remove` of `""`); an update whose before image holds another key also
  deletes the entity of that key;
- clientid: a UUID of the topic; request: the record's partition and offset, so a topic's
  records keep their Kafka order in the fold's (begun, clientid, request) order;
- begun: the Kafka timestamp;
- learning, includeBefore, includeAfter: the source's (default false).

Plain module: imported by Spark workers and tested without Kafka, Spark or Dagster.
"""

from __future__ import annotations

import base64
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel
from pydantic_core import from_json

from entity_assets import messages as m
from entity_assets import qlik
from entity_assets.patch import MAX_DEPTH, escape_token, nesting

FORMATS = ("db2", "goldengate", "debezium", "qlik")
AUTO = "auto"
"""Tells the formats apart per record: a Replicate envelope (`atMSG`) is Qlik's, a JSON value
with `op` (c/r/u/d/t/m) Debezium's, one with `op_type` GoldenGate's, anything else a DB2 row.
Name a system's format where a table has columns of those names."""

SUFFIX = "ingestion"
ANY_SYSTEM = "*"

_NAMESPACE = uuid.UUID("5f0c2d3e-8a1b-5c4d-9e6f-0a1b2c3d4e5f")
_OFFSET_BITS = 40
_LATE_OFFSET_BITS = 47


UNAVAILABLE_VALUE = "__debezium_unavailable_value"
"""Debezium's default `unavailable.value.placeholder`: the value of a column it did not read."""


def read_columns(row: dict, placeholder: str | None) -> dict | None:
    """`row` without the columns a connector did not read (their value its placeholder: as text,
    as a binary column's base64, or as an array's one element), or None if it read them all."""
    if not placeholder:
        return None
    unread = (placeholder, base64.b64encode(placeholder.encode()).decode())
    gone = {name for name, value in row.items()
            if (value.__class__ is str and value in unread) or (value.__class__ is list and value == [placeholder])}
    return {name: value for name, value in row.items() if name not in gone} if gone else None


@dataclass(frozen=True)
class Source:
    """How one source system's projections map to entities.

    `updates`: "replace" (the row after a change is the whole row, as the seeds say) or "merge"
    (its columns are set one by one and the others kept: connectors that send only the changed
    columns, such as GoldenGate with compressed updates).
    `collection`: "projection" (the topic's, as the seed names topics) or "table" (the table the
    record names, for connectors that route several tables to one topic; a record that names
    none keeps the projection).
    `includeBefore`, `includeAfter`: the batches ask for the document before and after each
    change in their entity updates, as the seed's projection-update message carries them.
    `schema_projection`: the projection of the topic Qlik Replicate writes its metadata
    messages to (its "schema topic", `<system>.<schema_projection>.ingestion`), which a slice
    reads before its data.
    `unavailable_value`: Debezium's placeholder of a column it did not read (PostgreSQL's TOASTed
    values an update did not change, with the default replica identity; Oracle's LOBs): a change
    holding one sets its other columns one by one, so the entity keeps that column's value.
    """

    system: str
    format: str = AUTO
    dbid: str | None = None
    zone: str | None = None
    learning: bool = False
    updates: str = "replace"
    collection: str = "projection"
    includeBefore: bool = False
    includeAfter: bool = False
    schema_projection: str | None = None
    unavailable_value: str | None = UNAVAILABLE_VALUE

    def __post_init__(self) -> None:
        if self.format != AUTO and self.format not in FORMATS:
            raise ValueError(f"unknown ingestion format {self.format!r}: one of {', '.join((AUTO, *FORMATS))}")
        if self.updates not in ("replace", "merge"):
            raise ValueError(f"unknown updates {self.updates!r}: replace or merge")
        if self.collection not in ("projection", "table"):
            raise ValueError(f"unknown collection {self.collection!r}: projection or table")


def parse_topic(topic: str, prefix: str) -> tuple[str, str] | None:
    """(source system, projection) of `<prefix><system>.<projection>.ingestion`, else None."""
    if not topic.startswith(prefix):
        return None
    parts = topic[len(prefix):].split(".")
    if len(parts) != 3 or parts[2] != SUFFIX or not parts[0] or not parts[1]:
        return None
    return parts[0], parts[1]


@lru_cache(maxsize=4096)
def client_id(topic: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, topic))


def request_id(partition: int, offset: int) -> int:
    """Unique per topic and ordered like its offsets within a partition: `partition << 40 |
    offset`, and past offset 2^40 (a year of 35k messages/s) `1 << 62 | partition << 47 |
    offset`, which is above every id of the first form (their partitions are below 2^22)."""
    if 0 <= offset < 1 << _OFFSET_BITS and 0 <= partition < 1 << (62 - _OFFSET_BITS):
        return partition << _OFFSET_BITS | offset
    if 0 <= offset < 1 << _LATE_OFFSET_BITS and 0 <= partition < 1 << (62 - _LATE_OFFSET_BITS):
        return 1 << 62 | partition << _LATE_OFFSET_BITS | offset
    raise m.InvalidMessage(m.DeadLetterCode.UNEXPECTED, f"partition {partition} or offset {offset} out of range")


# --------------------------------------------------------------------------- message shapes

class GoldenGateChange(BaseModel):
    """The value of an Oracle GoldenGate record. `pos` is required by the seed's spec, yet its
    examples omit it; it is not needed, so it is optional."""

    model_config = m.STRICT
    op_type: Literal["I", "U", "D"]
    before: m.Document | None = None
    after: m.Document | None = None
    pos: m.Long | str | None = None
    """An integer in the seed's spec; the JSON formatter writes a zero-padded string."""
    table: str | None = None
    """`SCHEMA.TABLE`; the collection is its last part with `collection="table"`."""
    primary_keys: list[str] | None = None
    """The key's columns (the formatter's `includePrimaryKeys`): an update's `before` then
    tells a changed key."""


class DebeziumChange(BaseModel):
    """The value of a Debezium record (the `payload` when the JSON converter embeds its schema).
    `source` is required by the seed's spec, yet its examples omit it; it is not needed."""

    model_config = m.STRICT
    op: Literal["c", "r", "u", "d"]
    before: m.Document | str | None = None
    after: m.Document | str | None = None
    """The row; the MongoDB connector's is the document as Extended JSON text."""
    source: m.Document | None = None
    """Where the change comes from; its `table` (MongoDB's `collection`) is the collection with
    `collection="table"`, its `connector` tells MongoDB's records."""

    @property
    def mongodb(self) -> bool:
        return isinstance(self.after, str) or isinstance(self.before, str) or (
            self.source is not None and self.source.get("connector") == "mongodb")


_ROWLESS_DEBEZIUM_OPS = {"t": "truncate", "m": "message"}
_ROWLESS_GOLDENGATE_OPS = {"T": "truncate"}


# --------------------------------------------------------------------------- one record

UPSERT, DELETE = "upsert", "delete"


def _json(raw: bytes, what: str) -> Any:
    m.check_size(raw, what)
    try:
        return _unwrapped(m.json_value(raw))
    except ValueError as exc:
        raise m.malformed_json(f"{what}: {exc}") from None


def _unwrapped(value: Any) -> Any:
    """Kafka Connect's JSON converter with schemas on wraps a key or value as {schema, payload},
    its schema an object (null for a null payload): a row of two columns so named is a row."""
    if isinstance(value, dict) and len(value) == 2 and "payload" in value and "schema" in value and (
            isinstance(value["schema"], dict) or value["schema"] is value["payload"] is None):
        return value["payload"]
    return value


DEBEZIUM_FIELDS = ("before", "after", "source")
"""Debezium's envelope holds one of these beside `op` (a truncate or message event: `source`)."""


def detect(value: Any) -> str:
    """`auto`'s format of a record value. An `op` beside an envelope's field is Debezium's
    whatever the op says, so a bad one is a dead letter, not a row of a DB2 table holding the
    whole envelope; an `op` or `op_type` alone is a DB2 row's column: taking `{"op": "d"}` for
    a delete would delete the row it upserts."""
    if isinstance(value, dict):
        if "op" in value and any(field in value for field in DEBEZIUM_FIELDS):
            return "debezium"
        if "op_type" in value and any(field in value for field in GOLDENGATE_FIELDS):
            return "goldengate"
    return "db2"


GOLDENGATE_METADATA = ("table", "op_type", "op_ts", "current_ts", "pos", "primary_keys", "tokens")
"""The JSON formatter's fields of an operation; its row-modeled messages (`format=json_row`) hold
the columns beside them."""
GOLDENGATE_FIELDS = ("before", "after", *(f for f in GOLDENGATE_METADATA if f != "op_type"))
"""What marks GoldenGate's message beside `op_type`: an image, or the formatter's metadata."""


def _row_modeled(value: Any) -> Any:
    """A GoldenGate `json_row` message in the operation-modeled form (`json`): its columns, the row
    after an insert or update (the row before a delete, which needs none), as `after`."""
    if not isinstance(value, dict) or "before" in value or "after" in value:
        return value
    columns = {name: v for name, v in value.items() if name not in GOLDENGATE_METADATA}
    return {**value, "after": columns} if columns else value


class Change(NamedTuple):
    kind: str
    """UPSERT or DELETE."""
    row: dict | None
    """The row after an upsert."""
    table: str | None
    """The table the record names, None where the format or the record does not name it."""
    update: GoldenGateChange | None = None
    """A GoldenGate update with a before image, which may hold another key."""
    mongodb: bool = False
    """A record of Debezium's MongoDB connector, whose key holds the `_id` as Extended JSON."""


def change(fmt: str, raw: bytes | None) -> Change:
    """The change one record value makes; InvalidMessage if it is bad."""
    if raw is None:
        return Change(DELETE, None, None)  # a tombstone: its key is gone
    if not raw:  # compaction keeps it, as a consumer should not take it for a delete: a producer's bug
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "empty value: a tombstone is a record without a "
                                                            "value (null), not one of no bytes")
    value = _json(raw, "value")
    if value is None:
        return Change(DELETE, None, None)
    fmt = detect(value) if fmt == AUTO else fmt
    if fmt == "db2":
        if not isinstance(value, dict):
            raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "value: a DB2 record is the row (an object) or null")
        return Change(UPSERT, value, None)
    field, rowless = ("op_type", _ROWLESS_GOLDENGATE_OPS) if fmt == "goldengate" else ("op", _ROWLESS_DEBEZIUM_OPS)
    if fmt in ("debezium", "goldengate") and isinstance(value, dict) and isinstance(value.get(field), str) and \
            value[field] in rowless:
        op = value[field]
        raise m.InvalidMessage(m.DeadLetterCode.UNSUPPORTED_TYPE,
                               f"{field}: '{op}' ({rowless[op]}) changes no row of a projection")
    if fmt == "goldengate":
        gg = m.parse_value(GoldenGateChange, _row_modeled(value))
        table = gg.table and gg.table.rsplit(".", 1)[-1]
        return _change(gg.op_type, gg.after, table, "op_type", update=gg if gg.op_type == "U" and gg.before else None)
    dbz = m.parse_value(DebeziumChange, value)
    table = dbz.source and (dbz.source.get("table") or dbz.source.get("collection"))
    if not dbz.mongodb:
        return _change(dbz.op, dbz.after, table, "op")
    if dbz.op == "u" and dbz.after is None:
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "after: a MongoDB update without its document (the "
                               "connector's capture.mode is not change_streams_update_full, or the document was "
                               "deleted before the connector read it)")
    return _change(dbz.op, mongo_document(dbz.after), table, "op", mongodb=True)


def _change(op: str, after: dict | None, table, field: str, **more) -> Change:
    table = table if isinstance(table, str) and table else None
    if op in ("D", "d"):
        return Change(DELETE, None, table, **more)
    if after is None:
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, f"after: field required for {field} '{op}'")
    return Change(UPSERT, after, table, **more)


# --------------------------------------------------------------------------- MongoDB

def mongo_document(text: str | dict | None) -> dict | None:
    """A MongoDB connector's document (Extended JSON text, relaxed or canonical) as the plain JSON
    an entity holds (`plain`)."""
    if text is None:
        return None
    try:
        doc = plain(m.json_value(text) if isinstance(text, str) else text)
    except ValueError as exc:
        raise m.malformed_json(f"after: {exc}") from None
    if not isinstance(doc, dict):
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "after: a MongoDB document is an object")
    return doc


def mongo_id(raw: bytes) -> str:
    """The entity id of a MongoDB connector's key, `{"id": <the _id as Extended JSON text>}`: the
    `_id`'s plain value as `entity_id` takes a key's (an ObjectId its hex, a number its JSON in
    either form, a string its text, a document its JSON), so that an id reads as the database shows it."""
    key = _json(raw, "key")
    text = key.get("id") if isinstance(key, dict) and len(key) == 1 else None
    if not isinstance(text, str):
        return entity_id(raw)[0]
    try:
        value = plain(m.json_value(text))
    except ValueError:
        return _plain_key(text.encode())  # an _id written bare (older connectors' strings)
    if isinstance(value, dict | list):
        return m.value_json(value)
    if not m.names_a_key(value):
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, f"key.id: {text[:80]!r} names no _id")
    return key_text(value)


def plain(value: Any) -> Any:
    """MongoDB Extended JSON's typed values as plain JSON: an ObjectId, a decimal, a symbol its
    text; a number (`$numberInt`, `$numberLong`, `$numberDouble`) the number (NaN and infinities,
    which JSON has not, their text); a date ISO 8601 text in UTC to the millisecond (its
    milliseconds past the years 1-9999); binary data its base64 (a UUID, subtype 4, its text);
    `undefined` null. Other types (timestamps, regular expressions, keys) stay as written."""
    if isinstance(value, list):
        return [plain(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) in (1, 2):
        typed = _typed(value)
        if typed is not _UNTYPED:
            return typed
    return {k: plain(v) for k, v in value.items()}


_UNTYPED = object()
_INTEGER = re.compile(r"-?[0-9]+")
_DOUBLE = re.compile(r"-?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")
_NUMBERS = {"$numberInt": (_INTEGER, int, 2**31), "$numberLong": (_INTEGER, int, 2**63),
            "$numberDouble": (_DOUBLE, float, None)}
"""Extended JSON's number texts, by the spec's grammar and range: Python's `int` and `float` also
take `1_000`, ` 7 ` and other scripts' digits, which no MongoDB writes."""


def _typed(value: dict) -> Any:
    [(name, inner), *rest] = value.items()
    if not rest:
        if name in ("$oid", "$numberDecimal", "$symbol", "$uuid") and isinstance(inner, str):
            return inner
        if name in _NUMBERS and isinstance(inner, str):
            grammar, kind, bound = _NUMBERS[name]
            if not grammar.fullmatch(inner):
                return inner if inner in ("NaN", "Infinity", "-Infinity") and kind is float else _UNTYPED
            digits = inner.lstrip("-").lstrip("0") or "0"
            if bound is not None and len(digits) > len(str(bound)):
                return _UNTYPED  # out of range, and past 4,300 digits int() refuses it (a GENERR007)
            number = kind(digits if inner[0] != "-" else "-" + digits) if bound is not None else kind(inner)
            if bound is not None and not -bound <= number < bound:
                return _UNTYPED
            return number if number not in (float("inf"), float("-inf")) else inner
        if name == "$date":
            return _date(inner)
        if name == "$undefined" and inner is True:
            return None
        if name == "$binary" and isinstance(inner, dict) and set(inner) == {"base64", "subType"}:
            return _binary(inner["base64"], inner["subType"])
    elif name == "$binary" and rest[0][0] == "$type":  # the legacy form
        return _binary(inner, rest[0][1])
    return _UNTYPED


def _date(inner) -> Any:
    """In whole milliseconds: through a float, dates far from 1970 came out a millisecond early."""
    if isinstance(inner, dict):
        inner = _typed(inner) if len(inner) == 1 else _UNTYPED
    if isinstance(inner, str):  # relaxed: ISO 8601 text
        try:
            at = datetime.fromisoformat(inner)
        except ValueError:
            return inner
        inner = ((at if at.tzinfo else at.replace(tzinfo=UTC)) - _EPOCH) // timedelta(milliseconds=1)
    if not isinstance(inner, int) or isinstance(inner, bool):
        return _UNTYPED
    try:
        return (_EPOCH + timedelta(milliseconds=inner)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    except OverflowError:
        return inner


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _binary(data, subtype) -> Any:
    if not isinstance(data, str) or not isinstance(subtype, str):
        return _UNTYPED
    if subtype in ("04", "4"):
        try:
            return str(uuid.UUID(bytes=base64.b64decode(data, validate=True)))
        except ValueError:
            return data
    return data


def key_before(update: GoldenGateChange, key_columns: list[str] | None) -> str | None:
    """The entity id of a GoldenGate update's old key, where the update changed it: the key's
    columns (a key object's fields, or the record's `primary_keys`) differ between `before` and
    `after`. The id is made in the form the record's key makes the new one: a key object's
    values joined as `entity_id` joins them, or GoldenGate's text of them joined by `_`."""
    columns = key_columns or update.primary_keys
    rows = (update.before, update.after or {})
    if not columns or not all(m.names_a_key(row.get(c)) for row in rows for c in columns):
        return None
    if all(update.before[c] == update.after[c] for c in columns):
        return None  # the same key: an ordinary update
    values = [key_text(update.before[c]) for c in columns]
    return joined_key(values) if key_columns else "_".join(values)


def entity_id(raw: bytes | None) -> tuple[str, list[str] | None]:
    """The primary key's values joined by underscores (an object key), or the key's text; and a
    key object's columns, which tell a GoldenGate update's old key."""
    if not raw:
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "key: the record has no key (the row's primary key)")
    try:
        key = _json(raw, "key")
    except m.InvalidMessage as exc:
        if exc.code in (m.DeadLetterCode.OVERSIZE, m.DeadLetterCode.BAD_FORMAT) or _json_but_nan(raw) or \
                _OBJECT.fullmatch(raw):  # BAD_FORMAT: JSON nested past the parser's limit
            raise
        return _plain_key(raw), None  # GoldenGate's `pk1_pk2` text, a braced GUID
    if not isinstance(key, dict) and not m.names_a_key(key):
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, f"key: {raw[:80]!r} names no primary key")
    if isinstance(key, dict):
        if not key:
            raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "key: the primary key has no fields")
        parts = []
        for name, value in key.items():
            if not m.names_a_key(value):
                raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, f"key.{name}: a key value must be a non-empty "
                                                                     "string, a number or a boolean")
            parts.append(key_text(value))
        return joined_key(parts), list(key)
    if isinstance(key, str) or raw.lstrip()[:1] == b"{":  # a string, or a wrapped payload's value
        return key_text(key), None
    return raw.decode(), None  # a number's text as written (`12.50`), as a plain key's


_OBJECT = re.compile(rb'\s*\{\s*".*\}\s*', re.DOTALL)
"""What a key object looks like, and no plain key does (a braced GUID, `{abc`, GoldenGate's
`{"a":1}_7`): one that does not parse is a malformed key object, a dead letter, not an entity id
of its text."""


def _json_but_nan(raw: bytes) -> bool:
    """Whether a key is a JSON object or array but for NaN or Infinity, which JSON has not: a
    key object with a bad value, not a plain key's text."""
    try:
        return isinstance(from_json(raw, allow_inf_nan=True), dict | list)
    except ValueError:
        return False


def _plain_key(raw: bytes) -> str:
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "key: neither JSON nor UTF-8 text") from None
    if not text.strip():
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "key: a blank key names no primary key")
    return text


def key_text(value) -> str:
    return value if isinstance(value, str) else m.value_json(value)


def joined_key(parts: list[str]) -> str:
    """A primary key's values joined by `_`, GoldenGate's key text. A field's own `_` (and `\\`)
    is escaped with `\\` when the key has several, so that ("x_y", "z") and ("x", "y_z") stay two
    entities; a key of one field is its text as it is."""
    if len(parts) == 1:
        return parts[0]
    return "_".join(p.replace("\\", "\\\\").replace("_", "\\_") if "_" in p or "\\" in p else p for p in parts)


def ops(kind: str, row: dict | None, *, merge: bool = False) -> list[dict]:
    """The patch of a change: the whole document, or with `merge` each column of the row (JSON
    Pointer paths, escaped), which also creates a missing entity; a delete removes the entity."""
    if kind == DELETE:
        return [{"op": "remove", "path": ""}]
    if not merge:
        return [{"op": "add", "path": "", "value": row}]
    if not row:
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "after: no column to merge")
    return [{"op": "add", "path": "/" + escape_token(name), "value": value}
            for name, value in row.items()]


def batch_values(source: Source, projection: str, topic: str, partition: int, offset: int, timestamp: int,
                 key: bytes | None, value: bytes | None, decoder: qlik.Decoder | None = None) -> tuple | qlik.Registered:
    """The entity_batches row values of one record, in `ingest.BATCH_FIELDS`' order; for a Qlik
    metadata message, the schema it registers (`decoder` holds the registry)."""
    if source.format == "qlik" or (source.format == AUTO and qlik.is_envelope(value)):
        decoded = (decoder or qlik.Decoder({})).decode(value or b"")
        if isinstance(decoded, qlik.Registered):
            return decoded
        row, primary_key, table, moved = decoded
        kind = DELETE if row is None else UPSERT
        entity = joined_key([key_text(v) for v in primary_key]) if primary_key else entity_id(key)[0]
        left = moved and joined_key([key_text(v) for v in moved])
    else:
        entity, key_columns = entity_id(key)
        kind, row, table, update, mongodb = change(source.format, value)
        entity = mongo_id(key) if mongodb else entity
        left = update and key_before(update, key_columns)
    if nesting(row, MAX_DEPTH) > MAX_DEPTH:  # every patch of it would fail; past ~196, explode could not read it
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, f"the row nests deeper than {MAX_DEPTH} levels, "
                                                             "a document's limit")
    collection = table if table and source.collection == "table" else projection
    zone = source.zone or source.system
    merge = source.updates == "merge"
    if kind == UPSERT and (read := read_columns(row, source.unavailable_value)) is not None:
        row, merge = read, True
    patches = [{"collection": collection, "zone": zone, "entity": entity, "ops": ops(kind, row, merge=merge)}]
    if left and left != entity:  # the update changed the row's key: its old entity is deleted
        patches.insert(0, {"collection": collection, "zone": zone, "entity": left, "ops": ops(DELETE, None)})
    return (client_id(topic), request_id(partition, offset), source.system, source.dbid or source.system,
            max(timestamp, 0), len(patches), m.value_json(patches), source.learning, source.includeBefore,
            source.includeAfter)
