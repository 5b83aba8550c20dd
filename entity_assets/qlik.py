"""The Qlik Replicate Avro envelope (seed 000): metadata messages register data schemas, data
messages are decoded by the schema id they reference.

An envelope (magic `atMSG`) holds either a metadata message (type MD, self-describing: its Avro
schema is embedded) that carries a table's data schema under a 32-byte schema id, or a data
message (type DT) encoded with a schema registered earlier. A data message whose schema is not
registered yet is `SchemaPending`: the ingest step keeps it in `schema_waits` and applies it in
the slice that brings its metadata message (docs/ingestion.md).

Plain module: fastavro and pydantic, no Kafka, Spark or Dagster.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import io
import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import fastavro
import fastavro.read
from pydantic import BaseModel, ConfigDict

from entity_assets import messages as m

MAGIC = b"atMSG"

ENVELOPE_SCHEMA = {
    "type": "record", "name": "MessageEnvelope",
    "fields": [
        {"name": "magic", "type": {"type": "fixed", "name": "Magic", "size": 5}},
        {"name": "type", "type": "string"},
        {"name": "headers", "type": ["null", {"type": "map", "values": "string"}]},
        {"name": "messageSchemaId", "type": ["null", "string"]},
        {"name": "messageSchema", "type": ["null", "string"]},
        {"name": "message", "type": "bytes"},
    ],
}
"""The seed's envelope schema, verbatim."""

_ENVELOPE = fastavro.parse_schema(ENVELOPE_SCHEMA)
_OPEN = ConfigDict(extra="ignore")
"""The messages Replicate writes inside the envelope: decoded by their own Avro schema already."""


class Envelope(BaseModel):
    model_config = m.STRICT
    magic: bytes
    type: Literal["MD", "DT"]
    headers: dict[str, str] | None = None
    messageSchemaId: str | None = None
    messageSchema: str | None = None
    message: bytes


class Lineage(BaseModel):
    """Where a metadata message's table comes from; only `table` is used."""

    model_config = _OPEN
    server: str | None = None
    task: str | None = None
    table: str | None = None
    tableVersion: int | None = None
    timestamp: str | None = None


class Column(BaseModel):
    model_config = _OPEN
    ordinal: int | None = None
    type: str | None = None
    primaryKeyPosition: int | None = None


class TableStructure(BaseModel):
    model_config = _OPEN
    tableColumns: dict[str, Column] = {}


class MetadataMessage(BaseModel):
    """An MD message: a table's data schema (Avro JSON text) under its schema id."""

    model_config = _OPEN
    schemaId: m.Name
    lineage: Lineage | None = None
    tableStructure: TableStructure | None = None
    dataSchema: m.Name


class DataHeaders(BaseModel):
    """A data message's headers; `operation` decides the change, the rest is the source's order."""

    model_config = _OPEN
    operation: Literal["INSERT", "UPDATE", "DELETE", "REFRESH"]
    changeSequence: str | None = None
    timestamp: str | None = None
    streamPosition: str | None = None
    transactionId: str | None = None


class DataMessage(BaseModel):
    """A DT message: the row after the change (`data`) and, for updates, before it."""

    model_config = _OPEN
    data: m.Document | None = None
    beforeData: m.Document | None = None
    headers: DataHeaders


@dataclass(frozen=True)
class Registered:
    """A data schema as a metadata message registered it: one `avro_schemas` row."""

    schema_id: str
    data_schema: str
    table: str | None = None
    primary_key: tuple[str, ...] = ()

    @classmethod
    def of(cls, md: MetadataMessage) -> Registered:
        columns = md.tableStructure.tableColumns if md.tableStructure else {}
        keyed = sorted((c.primaryKeyPosition, name) for name, c in columns.items() if c.primaryKeyPosition)
        return cls(md.schemaId, md.dataSchema, md.lineage.table if md.lineage else None,
                   tuple(name for _, name in keyed))

    @classmethod
    def from_row(cls, row: dict) -> Registered:
        return cls(row["schemaId"], row["dataSchema"], row["table"], tuple(json.loads(row["primaryKey"])))

    def values(self, system: str) -> tuple:
        """The row's values in `REGISTRY_FIELDS`' order."""
        return system, self.schema_id, self.table, json.dumps(list(self.primary_key)), self.data_schema


REGISTRY_FIELDS = ("system", "schemaId", "table", "primaryKey", "dataSchema")


class SchemaPending(m.InvalidMessage):
    """A data message whose schema id no metadata message has registered yet."""

    def __init__(self, schema_id: str):
        super().__init__(m.DeadLetterCode.SCHEMA_PENDING,
                         f"messageSchemaId {schema_id}: no metadata message has registered this schema yet; "
                         "applied in the slice that brings it")
        self.schema_id = schema_id

    def __reduce__(self):
        return SchemaPending, (self.schema_id,)


def is_envelope(raw: bytes | None) -> bool:
    return bool(raw) and raw[:5] == MAGIC


def envelope(raw: bytes) -> Envelope:
    m.check_size(raw, "value")
    if not is_envelope(raw):
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "value: not a Replicate envelope (no 'atMSG' magic)")
    env = m.parse_value(Envelope, _avro(raw, _ENVELOPE, "envelope"))
    if (env.messageSchema is None) == (env.messageSchemaId is None):
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT,
                               "envelope: exactly one of messageSchema and messageSchemaId must be set")
    return env


MAX_DECIMAL_BYTES = 128
"""The bytes of an Avro decimal read at most (308 digits): fastavro's conversion of a decimal
costs the square of its bytes, so one 1 MB record would hold a task 90 s."""


def _bounded(read_decimal):
    def read(data, writer_schema=None, reader_schema=None):
        if len(data) > MAX_DECIMAL_BYTES:
            raise ValueError(f"a decimal of {len(data)} bytes, past {MAX_DECIMAL_BYTES}")
        return read_decimal(data, writer_schema, reader_schema)
    return read


# fastavro's readers of every logical type are one table of the library's (`fastavro.read`'s,
# which its compiled reader shares): the decimals' are bounded there, for every schema decoded
for _kind in ("bytes-decimal", "fixed-decimal"):
    fastavro.read.LOGICAL_READERS[_kind] = _bounded(fastavro.read.LOGICAL_READERS[_kind])


def _avro(raw: bytes, schema, what: str) -> Any:
    stream = io.BytesIO(raw)
    try:
        value = fastavro.schemaless_reader(stream, schema, None)
    except Exception as exc:  # truncated or foreign bytes: fastavro raises several types
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, f"{what}: not decodable ({type(exc).__name__}: {exc})"[:300]) \
            from None
    if stream.tell() != len(raw):  # bytes of something else after it: not the message its writer meant
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, f"{what}: {len(raw) - stream.tell()} bytes after its value")
    return value


def _schema(text: str, what: str):
    named: dict = {}  # every named type, wherever it is defined (also under a top-level union or array)
    try:
        parsed = fastavro.parse_schema(json.loads(text), named_schemas=named)
    except Exception as exc:
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, f"{what}: not an Avro schema ({exc})"[:300]) from None
    if _contains_itself(parsed, named, set(), set()):
        # fastavro decodes a level per nested value, in C: 20 KB of them overflow the stack
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, f"{what}: a named type that contains itself "
                                                            "(a recursive schema): no table row is one")
    if _Expansion(named, what).of(parsed)[1] > MAX_EXTRA_VALUES:
        # two fields of the type before, twenty times: 2^20 records out of no bytes at all
        raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT,
                               f"{what}: a value of it decodes into more than {MAX_EXTRA_VALUES:,} values beyond "
                               f"{VALUES_PER_BYTE} a byte (named types that hold named types many times over): "
                               "no table row does")
    return parsed


VALUES_PER_BYTE = 4
MAX_EXTRA_VALUES = 10_000
"""A schema's value decodes into at most `VALUES_PER_BYTE` values (records, scalars, lists, map
entries) per byte read plus `MAX_EXTRA_VALUES`, or it is refused: a row of nullable columns is
one value per byte and its record, while types holding types twice over double per level."""

_MIN_BYTES = {"null": 0, "boolean": 1, "int": 1, "long": 1, "float": 4, "double": 8, "bytes": 1, "string": 1}


def _contains_itself(schema, named: dict, inside: set, acyclic: set) -> bool:
    """Whether a named type of `schema` reaches itself (a depth-first walk: `inside` the types
    being walked, `acyclic` those walked already, so a type used many times is walked once)."""
    if isinstance(schema, str):
        if schema in inside:
            return True
        return schema in named and schema not in acyclic and _contains_itself(named[schema], named, inside, acyclic)
    if isinstance(schema, list):
        return any(_contains_itself(branch, named, inside, acyclic) for branch in schema)
    kind = schema["type"]
    if kind in ("record", "error"):
        name = schema["name"]
        if name in acyclic:
            return False
        inside.add(name)
        if any(_contains_itself(f["type"], named, inside, acyclic) for f in schema["fields"]):
            return True
        inside.discard(name)
        acyclic.add(name)
        return False
    if kind in ("array", "map"):
        return _contains_itself(schema["items" if kind == "array" else "values"], named, inside, acyclic)
    return (not isinstance(kind, str) or kind in named) and _contains_itself(kind, named, inside, acyclic)


class _Expansion:
    """Walks a schema for the most values a value of each type decodes into beyond
    `VALUES_PER_BYTE` per byte it reads, each named type once: a type used twice in each of
    twenty nested types is 2^20 values, and walking it per use took as long."""

    def __init__(self, named: dict, what: str):
        self.named, self.what = named, what
        self.memo: dict[str, tuple[bool, int]] = {}

    def of(self, schema) -> tuple[bool, int]:
        """Whether a value of `schema` takes no bytes at all, and its values beyond
        `VALUES_PER_BYTE` a byte (negative: fewer)."""
        name = schema if isinstance(schema, str) else schema.get("name") if isinstance(schema, dict) else None
        if name not in self.named:
            return self._walk(schema)
        if name not in self.memo:
            self.memo[name] = self._walk(self.named[name])
        return self.memo[name]

    def _walk(self, schema) -> tuple[bool, int]:
        if isinstance(schema, str):
            return _MIN_BYTES[schema] == 0, 1 - VALUES_PER_BYTE * _MIN_BYTES[schema]
        if isinstance(schema, list):  # a union writes its branch's index (an empty one has no value)
            return False, max((self.of(branch)[1] for branch in schema), default=0) - VALUES_PER_BYTE
        kind = schema["type"]
        if kind in ("record", "error"):
            fields = [self.of(f["type"]) for f in schema["fields"]]
            return all(no_bytes for no_bytes, _ in fields), 1 + sum(extra for _, extra in fields)
        if kind == "fixed":
            return schema["size"] == 0, 1 - VALUES_PER_BYTE * schema["size"]
        if kind == "enum":
            return False, 1 - VALUES_PER_BYTE
        if kind == "array":
            self._repeated(*self.of(schema["items"]), "an array of items")
        elif kind == "map":  # an entry: its key (a string) and its value
            self._repeated(False, 1 - VALUES_PER_BYTE + self.of(schema["values"])[1], "a map of entries")
        else:
            return self.of(kind)
        return False, 1 - VALUES_PER_BYTE  # the list or dict, and the block count 0 that ends it

    def _repeated(self, no_bytes: bool, extra: int, what: str) -> None:
        """Items past `VALUES_PER_BYTE` a byte each: a 5-byte block count makes 10^12 of them."""
        if no_bytes:
            raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, f"{self.what}: {what} that take no bytes "
                                                                "(null, a record without fields)")
        if extra > 0:
            raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT,
                                   f"{self.what}: {what} that decode into more than {VALUES_PER_BYTE} values a byte")


class Decoder:
    """Decodes envelopes against a registry (schema id -> `Registered`), parsing each data
    schema once."""

    def __init__(self, registry: dict[str, Registered]):
        self.registry = registry
        self._parsed: dict[str, Any] = {}

    def decode(self, raw: bytes) -> Registered | tuple[dict | None, tuple | None, str | None, tuple | None]:
        """A metadata message's `Registered`, or a data message's (row after the change, None for
        a delete; its primary key values, None when its schema names no key; its table, None
        when no registered schema names it; the key values before an update that changed them,
        else None); `SchemaPending` or InvalidMessage otherwise."""
        try:
            return self._decode(raw)
        except RecursionError:  # walking a schema or converting a value, hundreds of levels deep
            raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "a schema or value nested deeper than a document "
                                                                "may be") from None

    def _decode(self, raw: bytes) -> Registered | tuple[dict | None, tuple | None, str | None, tuple | None]:
        env = envelope(raw)
        if env.type == "MD":
            if env.messageSchema is None:
                raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "envelope: a metadata message embeds its schema")
            md = m.parse_value(MetadataMessage, _avro(env.message, _schema(env.messageSchema, "messageSchema"),
                                                     "metadata message"))
            _schema(md.dataSchema, "dataSchema")
            return Registered.of(md)
        if env.messageSchemaId is None:
            schema = _schema(env.messageSchema, "messageSchema")
            registered = None
        else:
            registered = self.registry.get(env.messageSchemaId)
            if registered is None:
                raise SchemaPending(env.messageSchemaId)
            schema = self._parsed.get(registered.schema_id)
            if schema is None:
                schema = self._parsed[registered.schema_id] = _schema(registered.data_schema, "dataSchema")
        msg = m.parse_value(DataMessage, plain(_avro(env.message, schema, "data message")))
        row = msg.data if msg.data is not None else msg.beforeData
        if row is None:
            raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, "data message: neither data nor beforeData")
        key = None
        if registered and registered.primary_key:
            missing = [c for c in registered.primary_key if not m.names_a_key(row.get(c))]
            if missing:
                raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT,
                                       f"data: primary key column(s) {', '.join(missing)} missing, null, blank or "
                                       "not a scalar")
            key = tuple(row[c] for c in registered.primary_key)
        table = registered.table if registered else None
        if msg.headers.operation == "DELETE":
            return None, key, table, None
        if msg.data is None:
            raise m.InvalidMessage(m.DeadLetterCode.BAD_FORMAT, f"data: field required for operation "
                                                                f"'{msg.headers.operation}'")
        moved = None  # an update of the primary key: the row leaves its old key
        if key is not None and msg.beforeData is not None and msg.headers.operation == "UPDATE":
            before = tuple(msg.beforeData.get(c) for c in registered.primary_key)
            moved = before if before != key and all(map(m.names_a_key, before)) else None
        return msg.data, key, table, moved


_JSON_SCALARS = frozenset((str, int, float, bool, type(None)))


def plain(value: Any) -> Any:
    """Avro values as JSON values: bytes as base64, decimals as exact text, times as ISO 8601."""
    kind = type(value)
    if kind in _JSON_SCALARS:
        return value
    if kind is dict:
        return {k: v if type(v) in _JSON_SCALARS else plain(v) for k, v in value.items()}
    if kind is list:
        return [v if type(v) in _JSON_SCALARS else plain(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


# --------------------------------------------------------------------------- writing (samples, tests)

METADATA_SCHEMA = {
    "type": "record", "name": "MetadataMessage",
    "fields": [
        {"name": "schemaId", "type": "string"},
        {"name": "lineage", "type": {"type": "record", "name": "Lineage", "fields": [
            {"name": "server", "type": "string"}, {"name": "task", "type": "string"},
            {"name": "schema", "type": "string"}, {"name": "table", "type": "string"},
            {"name": "tableVersion", "type": "int"}, {"name": "timestamp", "type": "string"}]}},
        {"name": "tableStructure", "type": {"type": "record", "name": "TableStructure", "fields": [
            {"name": "tableColumns", "type": {"type": "map", "values": {
                "type": "record", "name": "Column", "fields": [
                    {"name": "ordinal", "type": "int"}, {"name": "type", "type": "string"},
                    {"name": "length", "type": "int"}, {"name": "precision", "type": "int"},
                    {"name": "scale", "type": "int"}, {"name": "primaryKeyPosition", "type": "int"}]}}}]}},
        {"name": "dataSchema", "type": "string"},
    ],
}
"""The metadata message as Replicate writes it (its own messages embed this schema)."""


def _encode(schema, record) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def data_schema(table: str, columns: dict[str, str]) -> dict:
    """A Replicate-style data schema: `data` and `beforeData` records of `columns` (name -> Avro
    type, all nullable) and the change headers."""
    row = {"type": "record", "name": "DataRecord", "fields": [{"name": c, "type": ["null", t]}
                                                              for c, t in columns.items()]}
    return {"type": "record", "name": f"{table}_message", "fields": [
        {"name": "data", "type": ["null", row]},
        {"name": "beforeData", "type": ["null", "DataRecord"]},
        {"name": "headers", "type": {"type": "record", "name": "Headers", "fields": [
            {"name": "operation", "type": {"type": "enum", "name": "Operation",
                                           "symbols": ["INSERT", "UPDATE", "DELETE", "REFRESH"]}},
            {"name": "changeSequence", "type": "string"}, {"name": "timestamp", "type": "string"},
            {"name": "streamPosition", "type": "string"}, {"name": "transactionId", "type": "string"}]}},
    ]}


def metadata_envelope(schema_id: str, table: str, columns: dict[str, str], primary_key: list[str]) -> bytes:
    """An MD envelope registering `data_schema(table, columns)` under `schema_id`."""
    md = {"schemaId": schema_id,
          "lineage": {"server": "replicate", "task": "sample", "schema": "dbo", "table": table, "tableVersion": 1,
                      "timestamp": "2026-01-01T00:00:00"},
          "tableStructure": {"tableColumns": {
              c: {"ordinal": i, "type": t.upper(), "length": 0, "precision": 0, "scale": 0,
                  "primaryKeyPosition": primary_key.index(c) + 1 if c in primary_key else 0}
              for i, (c, t) in enumerate(columns.items(), start=1)}},
          "dataSchema": json.dumps(data_schema(table, columns))}
    return _encode(ENVELOPE_SCHEMA, {"magic": MAGIC, "type": "MD", "headers": None, "messageSchemaId": None,
                                     "messageSchema": json.dumps(METADATA_SCHEMA),
                                     "message": _encode(METADATA_SCHEMA, md)})


def data_envelope(schema_id: str, schema: dict, operation: str, data: dict | None, before: dict | None = None) -> bytes:
    """A DT envelope of one change, encoded with `schema` (registered under `schema_id`)."""
    message = {"data": data, "beforeData": before,
               "headers": {"operation": operation, "changeSequence": "0" * 35, "timestamp": "2026-01-01T00:00:00",
                           "streamPosition": "0", "transactionId": "0" * 32}}
    return _encode(ENVELOPE_SCHEMA, {"magic": MAGIC, "type": "DT", "headers": None, "messageSchemaId": schema_id,
                                     "messageSchema": None, "message": _encode(schema, message)})
