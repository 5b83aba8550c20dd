"""Pydantic models of the Kafka stream messages (seed 004) and the hot-path parser.

Field names are the seed's wire names (``includeBefore``, ``appVersion``, ...) so that a model
attribute, a Delta column and a JSON key never need a mapping table. ``from``, a Python keyword,
is no attribute: ``FromOp`` is a TypedDict in the functional form, keyed ``"from"``.

The models of the streams the assets publish (``EntityPatch``, ``EntityUpdate``, ``SchemaUpdate``,
``PartialResponse``, ``DeviceNotification``, ... and ``TOPIC_MODELS``) are those streams' schema,
for consumers and the contract tests: production writes their messages as text (`core`, `encode`).

Pure pydantic on purpose: this module is imported by Spark workers and tests, and must stay
cheap to import and fast to run (validation happens in pydantic-core's Rust code; the few
Python validators are one call per model, not per field, but for the optional flags present).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeVar, get_args, get_type_hints

from typing_extensions import TypedDict

import jiter
import pydantic_core
from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StringConstraints,
    computed_field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "MAX_MESSAGE_BYTES",
    "STRICT",
    "DeadLetterCode",
    "InvalidMessage",
    "check_size",
    "parse_message",
    "value_json",
    "parse_value",
    "TOPIC_MODELS",
    "PatchOp",
    "ValueOp",
    "RemoveOp",
    "FromOp",
    "PatchSpec",
    "EntityBatch",
    "EntityPatch",
    "EntityUpdate",
    "SchemaPatch",
    "SchemaUpdate",
    "SchemaLearningEntityType",
    "PartialResponse",
    "CompleteResponse",
    "Connection",
    "ChangeByDevice",
    "DeviceNotification",
    "NotificationAck",
    "ZoneSubscription",
]

MAX_MESSAGE_BYTES = 1_000_000
"""The seed's 1000 KB message limit; larger records are dead-lettered before any parsing."""


class DeadLetterCode(StrEnum):
    """Codes written with each dead letter (and each wait for a Qlik schema, EA-SCHEMA-PENDING);
    GENERR* are the seed's, EA-* the project's own."""

    BAD_FORMAT = "GENERR001"
    UNSUPPORTED_TYPE = "GENERR002"
    MALFORMED_JSON = "GENERR007"
    UNEXPECTED = "GENERR009"
    INVALID_UUID = "GENERR010"
    OVERSIZE = "EA-OVERSIZE"
    SCHEMA_PENDING = "EA-SCHEMA-PENDING"
    SCHEMA_UNKNOWN = "EA-SCHEMA-UNKNOWN"
    EXPIRED = "EA-EXPIRED"


class InvalidMessage(Exception):
    """A record that must go to dead letters; ``reason`` names the offending field."""

    def __init__(self, code: DeadLetterCode, reason: str) -> None:
        # args == (code, reason) keeps the exception picklable across Spark workers.
        super().__init__(code, reason)
        self.code = code
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.code.value}: {self.reason}"


# --------------------------------------------------------------------------- field types

# Canonical 8-4-4-4-12 hex form, any version, either case. The check runs in Rust (pattern),
# and parse_message recognises its error type on ``clientid`` to answer GENERR010.
_UUID_PATTERN = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
ClientId = Annotated[str, StringConstraints(pattern=_UUID_PATTERN)]
# Identifiers become Kafka keys, partition values and Delta columns: empty ones are garbage.
Name = Annotated[str, StringConstraints(min_length=1)]
# An app version is counted by value in every later slice's `devices` commit and metadata
# (`app_versions`): a version a megabyte long would ride along for good.
APP_VERSION_CHARS = 128
AppVersion = Annotated[str, StringConstraints(min_length=1, max_length=APP_VERSION_CHARS)]
# Every integer lands in a Delta `long` column: a larger one is bad input, not a crashed task.
INT64_MAX = 2**63 - 1
Long = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
# The seed's `int`: part numbers land in Delta `integer` columns.
INT32_MAX = 2**31 - 1
Part = Annotated[int, Field(ge=1, le=INT32_MAX)]
# Literal[1, 2, 3] would accept JSON true and 1.0 even in strict mode; a bounded strict int won't.
Status = Annotated[int, Field(ge=1, le=3)]
Action = Literal["created", "updated", "deleted"]
Document = dict[str, Any]

STRICT = ConfigDict(strict=True, extra="ignore")
"""The input models' config (here, `adapters`, `qlik`): JSON's types as sent, no `"1"` for 1;
members a producer adds are no error."""
_STRICT = ConfigDict(**STRICT, populate_by_name=True)


class _Model(BaseModel):
    model_config = _STRICT


class _DbModel(_Model):
    """Accepts ``dbid`` (the tables) or ``db`` (the samples); rejects both when they differ.

    Serializes ``dbid`` under both names, because the seed's samples (so its clients) read ``db``.
    """

    # Only the raw "db" key, kept for the conflict check.
    db_given: str | None = Field(default=None, validation_alias="db", exclude=True, repr=False)

    @computed_field(repr=False)  # type: ignore[prop-decorator]
    @property
    def db(self) -> str:
        return self.dbid  # type: ignore[attr-defined,no-any-return]

    @model_validator(mode="after")
    def _db_matches_dbid(self) -> Any:
        db = self.db_given
        if db is not None and db != self.dbid:  # type: ignore[attr-defined]
            raise PydanticCustomError(
                "db_conflict",
                "'db' ({db}) and 'dbid' ({dbid}) differ",
                {"db": db, "dbid": self.dbid, "field": "dbid"},  # type: ignore[attr-defined]
            )
        return self


def _null_reads_as(default: Callable[[], Any]) -> BeforeValidator:
    """A null that reads as the field's absence: its default (a Python call per value present)."""
    return BeforeValidator(lambda value: default() if value is None else value)


Flag = Annotated[bool, _null_reads_as(bool)]
"""The seed's optional booleans ("boolean, default false"): a null reads as absent, as clients that
write their unset fields as null send it (a Python call per flag present; an absent one costs none)."""


class _Part(_Model):
    """A message that is one part of a request (its subclasses declare ``part`` and ``parts``)."""

    @model_validator(mode="after")
    def _part_within_parts(self) -> Any:
        """A part past its request's count would make the request look complete without a part."""
        part, parts = self.part, self.parts  # type: ignore[attr-defined]
        if part is not None and parts is not None and part > parts:
            raise PydanticCustomError(
                "part_over_parts",
                "part {part} of a request of {parts} parts",
                {"part": part, "parts": parts, "field": "part"},
            )
        return self


def _dbid() -> Any:
    return Field(validation_alias=AliasChoices("dbid", "db"))


# --------------------------------------------------------------------------- patches

# Ops are TypedDicts in a union tagged by ``op``: pydantic-core validates them without calling
# Python and yields the wire-form dicts the patch engine applies, which ingest stores as they
# are. Per op, a model with a Python validator and serializer cost more than the rest of a
# batch message.


class ValueOp(TypedDict):
    """add, replace, test: ``value`` must be present; null is a value."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    op: Literal["add", "replace", "test"]
    path: str
    value: Any


class RemoveOp(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    op: Literal["remove"]
    path: str


# ``from`` is a Python keyword, hence the functional form.
FromOp = TypedDict("FromOp", {"op": Literal["move", "copy"], "path": str, "from": str})
FromOp.__pydantic_config__ = _STRICT  # type: ignore[attr-defined]

PatchOp = Annotated[ValueOp | RemoveOp | FromOp, Field(discriminator="op")]
"""One JSON-Patch-like operation, as a dict in the wire form (members other than the op's own
are dropped)."""

_OP_NAMES = frozenset(name for op in (ValueOp, RemoveOp, FromOp) for name in get_args(get_type_hints(op)["op"]))

# Serialized as the dicts they are: exclude_none must not drop a null ``value``.
Ops = Annotated[list[PatchOp], Field(min_length=1, fail_fast=True), PlainSerializer(list, return_type=list[Any])]


class PatchSpec(TypedDict):
    """One patch inside an entity batch (the seed's "raw patch document")."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    collection: Name
    zone: Name
    entity: Name
    ops: Ops


# --------------------------------------------------------------------------- entity streams


def request_key(clientid: str, request: int) -> str:
    """A request's id, unique per client: the key of its entity-batches record and its responses."""
    return f"{clientid}/{request}"


class EntityBatch(_DbModel):
    """entity-batches: a client's request over several entities, keyed by request id."""

    clientid: ClientId
    request: Long
    user: Name
    dbid: Name = _dbid()
    begun: Long
    patches: Annotated[list[PatchSpec], Field(min_length=1, fail_fast=True)]
    learning: Flag = False
    includeBefore: Flag = False
    includeAfter: Flag = False


class EntityPatch(_DbModel, _Part):
    """entity-patches: one patch of a batch, keyed by entity id."""

    clientid: ClientId
    request: Long
    user: Name
    dbid: Name = _dbid()
    collection: Name
    zone: Name
    entity: Name
    parts: Part
    part: Part
    begun: Long
    ops: Ops
    learning: Flag = False
    includeBefore: Flag = False
    includeAfter: Flag = False


class _Outcome(_Part):
    """The outcome fields shared by entity-updates and schema-updates.

    ``before``/``after`` are tri-state: unset = not requested (omitted on output), None = the
    entity did not exist (before) or was deleted (after), written as null.
    """

    ended: Long
    status: Status
    error: str | None = None
    before: Document | None = None
    after: Document | None = None


class EntityUpdate(EntityPatch, _Outcome):
    """entity-updates (and zone-changes): the applied patch and its outcome."""


class SchemaPatch(_DbModel, _Part):
    """schema-patches: one patch to a database schema, keyed by database id."""

    clientid: ClientId
    request: Long
    user: Name
    dbid: Name = _dbid()
    parts: Part
    part: Part
    begun: Long
    ops: Ops
    includeBefore: Flag = False
    includeAfter: Flag = False


class SchemaUpdate(SchemaPatch, _Outcome):
    """schema-updates: a processed schema patch and its outcome (status 1, or 3 with `error`)."""


class SchemaLearningEntityType(_DbModel, _Part):
    """schema-learning entity-type message.

    The seed's table requires ``parts`` (entity types in the schema) but its sample carries only
    ``part``; both are accepted and at least one must be present.
    """

    clientid: ClientId
    request: Long
    user: Name
    dbid: Name = _dbid()
    parts: Part | None = None
    part: Part | None = None
    begun: Long
    status: Annotated[int, Field(ge=1, le=1)]
    after: Document

    @model_validator(mode="after")
    def _part_or_parts(self) -> SchemaLearningEntityType:
        if self.parts is None and self.part is None:
            raise PydanticCustomError(
                "missing", "field required ('parts' or 'part')", {"field": "parts"}
            )
        return self


class PartialResponse(_DbModel, _Part):
    """partial-responses: the seed's minimal header, plus the whole entity/schema update.

    Extra keys are kept as parsed (unvalidated) so the response is republished unchanged,
    nulls included.
    """

    model_config = ConfigDict(extra="allow")

    clientid: ClientId
    request: Long
    user: Name
    dbid: Name = _dbid()
    parts: Part
    part: Part
    begun: Long
    ended: Long
    status: Status


class CompleteResponse(_Model):
    """complete-responses: all partial responses of one request (``responses`` kept verbatim)."""

    clientid: ClientId
    request: Long
    user: Name
    parts: Part
    begun: Long
    ended: Long
    responses: list[Document]


class Connection(_DbModel):
    """connections: which device/app version a user connects with, keyed by username."""

    clientid: ClientId
    dbid: Name = _dbid()
    user: Name
    device: Name
    appVersion: AppVersion  # a version the app-version counts can name
    begun: Long


class ChangeByDevice(_DbModel):
    """changes-by-device: one change summary for one device (the device is the Kafka key)."""

    dbid: Name = _dbid()
    collection: Name
    zone: Name
    entity: Name
    notification: Name
    action: Action
    ended: Long


class DeviceNotification(_DbModel):
    """device-notifications: a device's unacknowledged notifications summary."""

    dbid: Name = _dbid()
    user: Name
    device: Name
    count: Annotated[int, Field(ge=0, le=INT64_MAX)]
    begun: Long
    ended: Long


# --------------------------------------------------------------------------- project-defined


class NotificationAck(_DbModel):
    """notification-acks (project-defined; the seed leaves acknowledgement open). Key: device.

    An app acknowledges either listed notification ids (``notifications``) or everything up to a
    point (``upTo``: every notification with ``ended <= upTo``), or both; an ack naming neither
    is rejected. ``begun`` is the app's own timestamp of the ack.
    """

    dbid: Name = _dbid()
    user: Name
    device: Name
    notifications: Annotated[list[Name], Field(fail_fast=True)] | None = None
    upTo: Long | None = None
    begun: Long

    @model_validator(mode="after")
    def _acknowledges_something(self) -> NotificationAck:
        if not self.notifications and self.upTo is None:
            raise PydanticCustomError(
                "missing",
                "field required: non-empty 'notifications' or 'upTo'",
                {"field": "notifications"},
            )
        return self


_ALL_ACTIONS: tuple[Action, ...] = ("created", "updated", "deleted")


def _all_actions() -> list[Action]:
    return list(_ALL_ACTIONS)


class ZoneSubscription(_Model):
    """Document of an entity of the built-in ``$zoneSubscription`` collection (project-defined).

    The seed stores subscriptions as entities but leaves their fields open. Partitioning is by
    ``subjectZone`` (the zone watched), not by the subscription entity's own zone.
    ``subjectCollection`` None means every collection; ``actions`` defaults to all three (null too,
    as for the optional flags).
    """

    subjectZone: Name
    subjectCollection: Name | None = None
    device: Name
    user: Name
    actions: Annotated[list[Action], Field(min_length=1, fail_fast=True), _null_reads_as(_all_actions)] = Field(
        default_factory=_all_actions
    )

    def covers(self, collection: str, action: str) -> bool:
        """Whether a change in this zone should notify the subscribed device."""
        return covers(self.subjectCollection, self.actions, collection, action)


def covers(subject_collection: str | None, actions, collection: str, action: str) -> bool:
    """`ZoneSubscription.covers` of a subscription's two fields, as `notify.SubscriptionIndex` keeps them."""
    return (subject_collection is None or subject_collection == collection) and action in actions


TOPIC_MODELS: dict[str, type[BaseModel]] = {
    "entity-batches": EntityBatch,
    "entity-patches": EntityPatch,
    "entity-updates": EntityUpdate,
    "zone-changes": EntityUpdate,
    "schema-patches": SchemaPatch,
    "schema-updates": SchemaUpdate,
    "partial-responses": PartialResponse,
    "complete-responses": CompleteResponse,
    "connections": Connection,
    "changes-by-device": ChangeByDevice,
    "device-notifications": DeviceNotification,
    "notification-acks": NotificationAck,
}
"""Single-shape topics and their model. schema-learning carries two shapes (EntityUpdate and
SchemaLearningEntityType), so it is left to the caller."""


# --------------------------------------------------------------------------- parsing

T = TypeVar("T", bound=BaseModel)

_MAX_REASONS = 3
# Our own errors raised at model level name their field in ctx, so the reason can point at it.
_OWN_ERROR_TYPES = frozenset(("db_conflict", "missing", "part_over_parts"))
_NOT_OBJECT_TYPES = frozenset(("model_type", "model_attributes_type", "dict_type"))


def _path(loc: tuple) -> str:
    return ".".join(str(part) for part in loc) or "message"


def _reason(err: Any) -> str:
    """``loc: message``, with PatchOp's union tag read as the op it names.

    pydantic puts the tag into the location (``ops.1.add.value``) and words a bad tag as a
    union error; the client wrote ``ops.1.value`` of an ``add`` and ``ops.1.op``.
    """
    loc, kind, msg = err["loc"], err["type"], err["msg"]
    ctx = err.get("ctx") or {}
    if kind == "union_tag_invalid":
        return f"{_path((*loc, 'op'))}: input should be {ctx['expected_tags']}"
    if kind == "union_tag_not_found":
        return f"{_path((*loc, 'op'))}: field required"
    for i in range(1, len(loc) - 1):
        if loc[i] in _OP_NAMES and isinstance(loc[i - 1], int):
            if kind == "missing":
                msg = f"field required for op '{loc[i]}'"
            loc = (*loc[:i], *loc[i + 1:])
            break
    if "field" in ctx and kind in _OWN_ERROR_TYPES:
        loc = (*loc, ctx["field"])
    return f"{_path(loc)}: {msg[:1].lower()}{msg[1:]}"


def _is_bad_uuid(err: Any) -> bool:
    return err["type"] == "string_pattern_mismatch" and err["loc"] == ("clientid",)


def _classify(exc: ValidationError) -> InvalidMessage:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    kind = first["type"]
    if kind == "json_invalid":
        return malformed_json(first["msg"])
    if kind in _NOT_OBJECT_TYPES and not first["loc"]:
        return InvalidMessage(DeadLetterCode.BAD_FORMAT, "message is not a JSON object")
    code = DeadLetterCode.BAD_FORMAT
    for err in errors:
        if _is_bad_uuid(err):
            code = DeadLetterCode.INVALID_UUID
            break
    parts = []
    for err in errors[:_MAX_REASONS]:
        if _is_bad_uuid(err):
            parts.append("clientid: not a UUID (8-4-4-4-12 hex)")
            continue
        parts.append(_reason(err))
    reason = "; ".join(parts)
    if len(errors) > _MAX_REASONS:
        reason += f" (+{len(errors) - _MAX_REASONS} more)"
    return InvalidMessage(code, reason)


def malformed_json(reason: str) -> InvalidMessage:
    """GENERR007; but JSON nested past the parser's limit (about 200 levels) is well formed and
    past a document's (100): GENERR001, as a shallower one's patch fails for its depth."""
    if "recursion limit exceeded" in reason:
        return InvalidMessage(DeadLetterCode.BAD_FORMAT, f"{reason}: nested deeper than a document may be")
    return InvalidMessage(DeadLetterCode.MALFORMED_JSON, reason)


def names_a_key(value) -> bool:
    """Whether a CDC primary key column's value can be part of an entity id: a scalar, not blank
    (a stricter rule than a native batch's `entity`, which any non-empty `Name` may be)."""
    return value is not None and not isinstance(value, dict | list) and not (isinstance(value, str) and not value.strip())


def check_size(raw: bytes | bytearray, what: str = "message") -> None:
    """The seed's size limit, before any parsing: EA-OVERSIZE over `MAX_MESSAGE_BYTES`."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise InvalidMessage(DeadLetterCode.OVERSIZE, f"{what} is {len(raw)} bytes, over {MAX_MESSAGE_BYTES}")


def parse_message(model: type[T], raw: bytes | bytearray | memoryview | str | None) -> T:
    """Validate one Kafka record value, or raise InvalidMessage carrying its dead-letter code.

    The size check comes first so an oversize record never reaches the JSON parser.
    """
    if not raw:
        raise InvalidMessage(DeadLetterCode.BAD_FORMAT, "empty message value")
    if type(raw) is memoryview:
        raw = raw.tobytes()
    elif type(raw) is str:
        raw = raw.encode()
    check_size(raw)
    if b"NaN" in raw or b"Infinity" in raw:
        _json_constants(raw)
    try:
        message = model.__pydantic_validator__.validate_json(raw)
    except ValidationError as exc:
        raise _classify(exc) from None
    except Exception as exc:  # never let one record kill a slice
        raise InvalidMessage(DeadLetterCode.UNEXPECTED, f"{type(exc).__name__}: {exc}"[:300]) from exc
    try:
        json_value(raw, allow_inf_nan=True)  # the validator keeps a repeated name's last value
    except InvalidMessage:
        raise
    except ValueError:
        pass  # well formed by the validator's limits, which the model's own checks hold
    return message  # type: ignore[return-value]


REPEATED_NAME = "Detected duplicate key"
"""jiter's words for a name repeated in one object."""


def json_value(raw: bytes | bytearray | str, *, allow_inf_nan: bool = False) -> Any:
    """An input's JSON, whose objects name each member once: GENERR001 otherwise. JSON leaves a
    repeated name's meaning open (RFC 8259) and parsers keep the last value, so an op written
    `{"op": "add", ..., "op": "remove"}` would delete what it was sent to add (RFC 6902, A.13)."""
    data = raw if type(raw) is bytes else raw.encode() if isinstance(raw, str) else bytes(raw)
    try:
        return jiter.from_json(data, allow_inf_nan=allow_inf_nan, catch_duplicate_keys=True, cache_mode="keys")
    except ValueError as exc:
        if str(exc).startswith(REPEATED_NAME):
            raise InvalidMessage(DeadLetterCode.BAD_FORMAT, f"a name repeated in one object ({exc}): "
                                 "which value is meant cannot be told") from None
        raise


def _json_constants(raw: bytes) -> None:
    """GENERR007 for NaN and Infinity, which pydantic-core reads as floats (most often the words
    are inside strings, and this second, strict parse finds nothing)."""
    try:
        pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        try:
            pydantic_core.from_json(raw)
        except ValueError:
            return  # malformed anyway: the validation says where
        raise InvalidMessage(DeadLetterCode.MALFORMED_JSON, f"NaN or Infinity, which JSON does not have: {exc}") from None


def value_json(value: Any) -> str:
    """An input's JSON values as text for the lake: GENERR001 for a number past a double
    (`1e400`), which parses as Infinity and would be written as that bare word, no JSON, and for
    a lone surrogate (a name in an Avro schema's JSON text may be one), which UTF-8 cannot hold."""
    try:
        text = pydantic_core.to_json(value).decode()
    except pydantic_core.PydanticSerializationError as exc:
        raise InvalidMessage(DeadLetterCode.BAD_FORMAT, f"text that is no Unicode ({exc})"[:300]) from None
    if "NaN" in text or "Infinity" in text:
        try:
            pydantic_core.from_json(text, allow_inf_nan=False)
        except ValueError:
            raise InvalidMessage(
                DeadLetterCode.BAD_FORMAT, "a number beyond the range of a double (such as 1e400), or NaN"
            ) from None
    return text


def parse_value(model: type[T], value: Any) -> T:
    """`parse_message` of a value already decoded from JSON (an adapter's, after unwrapping it)."""
    try:
        return model.__pydantic_validator__.validate_python(value)  # type: ignore[return-value]
    except ValidationError as exc:
        raise _classify(exc) from None
