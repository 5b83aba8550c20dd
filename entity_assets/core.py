"""The entity core as pure functions: batches to patches, patches to updates and responses.

Nothing here knows Dagster or Spark; the assets call these inside Spark tasks. Rows are
plain dicts with the column names of `tables.SCHEMAS`; JSON documents are text.

Order of application (docs/entity-core.md): within a slice, the patches of one entity apply
in (begun, clientid, request, part) order, all fields of the messages themselves, so the
result does not depend on which Kafka partition a batch landed on. Across slices, slice
order wins.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pydantic_core import from_json, to_json

from entity_assets.patch import (
    MAX_DOCUMENT_BYTES,
    STATUS_FAILED,
    STATUS_OK,
    PatchError,
    apply_patch,
    growth_bound,
    is_delete,
)

STATE_BUCKETS = 32
"""Hash buckets of the entity state. Fixed for the life of a lake: changing it needs a rebuild."""

ORDER = ("begun", "clientid", "request", "part")
ENTITY_KEY = ("dbid", "collection", "zone", "entity")
BATCH_IDENTITY = ("clientid", "request")
SCHEMA_PATCH_IDENTITY = ("clientid", "request", "part")
"""What makes a message of a request the same message: its deliveries after the first are left out."""


def dumps(value) -> str:
    """Compact JSON, non-ASCII kept. pydantic-core's serializer: about 4x the stdlib's speed, and
    every patch's ops, documents and messages pass through here."""
    return to_json(value).decode()


def loads(text: str | bytes):
    """pydantic-core's parser (the one that validated the input at ingest): 2-3x the stdlib's speed."""
    return from_json(text)


def key_bucket(key: str) -> int:
    """The state bucket of a key's text. Stable across processes and machines (Python's hash() is
    not); Spark's `crc32(...) % STATE_BUCKETS` gives the same."""
    return zlib.crc32(key.encode()) % STATE_BUCKETS


def bucket_of(dbid: str, collection: str, zone: str, entity: str) -> int:
    return key_bucket(f"{dbid}\x1f{collection}\x1f{zone}\x1f{entity}")


PATCH_FROM_BATCH = ("slice", "kafka_topic", "kafka_partition", "kafka_offset", "kafka_timestamp", "clientid",
                    "request", "user", "dbid", "begun", "learning", "includeBefore", "includeAfter")
"""The entity_patches columns a patch takes from its batch's row."""
PATCH_FIELDS = ("collection", "zone", "entity", "parts", "part", "ops", "bucket")
"""The entity_patches columns of each patch (`explode`)."""


def explode(dbid: str, patches: str) -> list[tuple]:
    """The `PATCH_FIELDS` of each patch of a batch (`patches`: its JSON text); part is 1-based in batch order."""
    items = loads(patches)
    parts = len(items)
    return [(p["collection"], p["zone"], p["entity"], parts, part, dumps(p["ops"]),
             bucket_of(dbid, p["collection"], p["zone"], p["entity"])) for part, p in enumerate(items, start=1)]


def ended_of(kafka_timestamp: int | None, begun: int) -> int:
    """Completion time from the message itself (its Kafka timestamp), never the wall clock."""
    return max(kafka_timestamp or 0, begun)


class DocState:
    """A document (an entity, or a database schema) and its version while a slice folds over it."""

    __slots__ = ("doc", "version", "changed", "ended", "size")

    def __init__(self, row: dict | None = None):
        if row is None:
            self.doc, self.version, self.ended = None, 0, None
        else:
            self.doc = None if row["deleted"] or row["document"] is None else loads(row["document"])
            self.version, self.ended = row["version"], row["ended"]
        self.changed = False
        self.size = 0 if self.doc is None else len(row["document"])  # at least its JSON text's (`_bounded_size`)

    def row(self, key: dict, slice_key: str, bucket: int) -> dict:
        return {**key, "slice": slice_key, "version": self.version, "deleted": self.doc is None,
                "document": None if self.doc is None else dumps(self.doc), "ended": self.ended, "bucket": bucket}


def apply(state: DocState, ops: str, ended: int, include_before: bool, include_after: bool, *,
          implicit_empty: bool = False, check: Callable[[Any, Any], str | None] | None = None,
          sized: bool = True) -> tuple[int, str | None, str | None, str | None, str | None]:
    """Applies one patch's ops (JSON text) to `state`: (status, error, before, after, action).

    `before`/`after` are JSON texts, given only where asked for (`before` None on a creation).
    `implicit_empty`: a missing document counts as `{}` (every database has a schema), so
    schema patches end with status 1 or 3, never 2. `check(before, after)`: what makes the
    patched document invalid, which fails the patch (status 3) as a failed op would. `sized`:
    a patch that takes the document past `MAX_DOCUMENT_BYTES`, or shifts more than `MAX_SHIFTS`
    array elements, fails; a replay of updates applied already (`history`) leaves both out, as a
    lake written before the limits may hold such ones.
    """
    before, items = state.doc, loads(ops)
    known = None if not sized else 2 if before is None else state.size  # a missing document patches `{}`
    if implicit_empty:  # a schema is never absent: a tombstone would read as none
        deleting = next((i for i, op in enumerate(items) if is_delete(op)), None) if isinstance(items, list) else None
        if deleting is not None:
            return STATUS_FAILED, str(PatchError(deleting, items[deleting], SCHEMA_KEPT)), None, None, None
        outcome = apply_patch({} if before is None else before, items, document="a database's schema", size=known,
                              limited=sized)
    else:
        outcome = apply_patch(before, items, size=known, limited=sized)
    if outcome.status != STATUS_OK:
        return outcome.status, outcome.error, None, None, None
    if check is not None and outcome.doc is not None and (error := check(before, outcome.doc)):
        return STATUS_FAILED, error, None, None, None
    size = _bounded_size(outcome.size, ops, items, outcome.doc) if sized else 0
    if size > MAX_DOCUMENT_BYTES:
        return STATUS_FAILED, f"the document would be over {MAX_DOCUMENT_BYTES} bytes of JSON", None, None, None
    state.doc, state.version, state.changed, state.ended = outcome.doc, state.version + 1, True, ended
    state.size = size
    return (STATUS_OK, None, dumps(before) if include_before and before is not None else None,
            dumps(outcome.doc) if include_after and outcome.doc is not None else None,
            action_of(created=before is None, deleted=outcome.deleted))


SCHEMA_KEPT = "a database's schema is not deleted: replace it with {} to empty it"


def action_of(created: bool, deleted: bool) -> str:
    """The change action of a successful update.

    ``created``: the document did not exist before (a database's first schema patch included,
    applied to ``{}``); ``deleted``: the patch removed it. Never both: a missing entity is created
    by adds only, and `apply` refuses a schema's deletion.
    """
    if deleted:
        return "deleted"
    return "created" if created else "updated"


GROWTH_PER_OPS_CHARACTER = 7
"""How much a patch's ops text may grow its document's, a copy aside: a value by its own text,
a parent that an add or move creates by its token's and 6 more (`"a":{},` for `/a`)."""


def _bounded_size(size: int, ops: str, items: list, doc) -> int:
    """A bound of a patched document's JSON text (characters) that only a document whose bound of
    its ops' growth (`growth_bound`) passes `MAX_DOCUMENT_BYTES` pays a measure for; `size`: the
    patch's bound of it, the growth of its copies included (`PatchOutcome.size`). Unbounded,
    patches of a few bytes would grow a document past what a column of text holds (2 GiB)."""
    if doc is None:
        return 0
    bound = size + GROWTH_PER_OPS_CHARACTER * len(ops)
    if bound > MAX_DOCUMENT_BYTES:
        bound = size + growth_bound(items)
    if bound > MAX_DOCUMENT_BYTES:
        return len(dumps(doc))
    return bound


RESULT_FIELDS = ("status", "error", "before", "after", "action")
"""What `apply` gives, in its order: a result row is the patch's row, `ended` and these."""


def apply_one(state: DocState, patch: dict, *, implicit_empty: bool = False,
              check: Callable[[Any, Any], str | None] | None = None) -> dict:
    """`apply` of one patch row; returns its result row (every status)."""
    ended = ended_of(patch["kafka_timestamp"], patch["begun"])
    result = dict(patch)
    result.pop("bucket", None)
    result["ended"] = ended
    result.update(zip(RESULT_FIELDS, apply(state, patch["ops"], ended, patch["includeBefore"], patch["includeAfter"],
                                           implicit_empty=implicit_empty, check=check)))
    return result


def learned_after(after: str | None, doc: dict) -> str:
    """The `after` of an update's schema-learning message (kind "entity", otherwise the update's
    row): the update's own when the request asked for it, else the document, which learning
    always needs."""
    return after if after is not None else dumps(doc)


ENTITY_TYPE = "entity-type"
"""The `kind` of a schema-learning row of an entity type (the others: "entity")."""


def entity_type_rows(result: dict, schema: dict) -> list[dict]:
    """schema-learning entity-type messages: one per entity type of the updated schema.

    The header of the schema update (its flags too), no ops, `parts` the number of types, `after`
    that type only, and never `before`. The row's `collection` names the type, which partitions
    the topic; the message leaves it out, as the seed's sample does ("the same header fields as
    the schema-updates messages").
    """
    types = sorted(name for name, value in schema.items() if isinstance(value, dict))
    return [
        {**result, "collection": name, "zone": None, "entity": None, "ops": None, "before": None,
         "after": dumps({name: schema[name]}), "parts": len(types), "part": part, "kind": ENTITY_TYPE}
        for part, name in enumerate(types, start=1)
    ]


# --------------------------------------------------------------------------- messages
# Message texts are spliced from the header fields and the documents already held as JSON
# text (ops, before, after, responses), so a document is serialized once, not per stream.

_REQUEST_FIELDS = ("clientid", "request", "user")
_UPDATE_FIELDS = ("collection", "zone", "entity", "parts", "part", "begun")


def _object(fields: dict, documents: dict[str, str | None]) -> str:
    """JSON text of `fields` followed by `documents`, values that are JSON text already."""
    text = dumps(fields)
    if not documents:
        return text
    tail = ",".join(f'"{name}":{"null" if doc is None else doc}' for name, doc in documents.items())
    return f"{text[:-1]},{tail}}}" if fields else f"{{{tail}}}"


def result_json(row: dict) -> str:
    """The entity-updates / schema-updates / partial-responses message of a result row.

    `before` and `after` appear only when the request asked for them; a requested `before`
    is null when the patch created the entity (the seed's sample).
    """
    msg = {"dbid": row["dbid"], "db": row["dbid"]}
    for name in _REQUEST_FIELDS:
        msg[name] = row[name]
    for name in _UPDATE_FIELDS:
        if row.get(name) is not None and not (name == "collection" and row.get("kind") == ENTITY_TYPE):
            msg[name] = row[name]
    msg["status"] = row["status"]
    msg["ended"] = row["ended"]
    if row.get("learning"):
        msg["learning"] = True
    for flag in ("includeBefore", "includeAfter"):
        if row.get(flag):
            msg[flag] = True
    documents = {}
    if row.get("ops") is not None:
        documents["ops"] = row["ops"]
    if row["status"] != STATUS_OK:
        msg["error"] = row["error"]
    else:
        if row.get("includeBefore") and row.get("kind") != ENTITY_TYPE:  # a type's message: its `after` alone
            documents["before"] = row["before"]
        if row.get("includeAfter") or row.get("kind"):  # schema-learning rows always carry after
            documents["after"] = row["after"]
    return _object(msg, documents)


def complete_row(parts: list[dict], slice_key: str) -> dict:
    """The complete-responses row of a request whose parts are all processed (sorted by part).

    Its `ended` is its parts' latest; its Kafka coordinates those of the part of this slice that
    ended last (a tie: the higher part), so that part's record's trail, which reads its own slice,
    shows the response: a part pending from an earlier slice may have ended later."""
    first = parts[0]
    last = max([p for p in parts if p.get("slice") == slice_key] or parts, key=lambda r: (r["ended"], r["part"]))
    return {
        "slice": slice_key, "kafka_topic": last["kafka_topic"], "kafka_partition": last["kafka_partition"],
        "kafka_offset": last["kafka_offset"], "kafka_timestamp": last["kafka_timestamp"],
        "clientid": first["clientid"], "request": first["request"], "user": first["user"], "dbid": first["dbid"],
        "parts": len(parts), "begun": first["begun"], "ended": max(p["ended"] for p in parts),
        "responses": "[" + ",".join(result_json(p) for p in parts) + "]",
    }


def patch_json(row: dict) -> str:
    """The entity-patches message of a patch row."""
    msg = {"dbid": row["dbid"], "db": row["dbid"]}
    for name in _REQUEST_FIELDS + _UPDATE_FIELDS:
        msg[name] = row[name]
    for flag in ("learning", "includeBefore", "includeAfter"):
        if row.get(flag):
            msg[flag] = True
    return _object(msg, {"ops": row["ops"]})


def complete_json(row: dict) -> str:
    return _object({k: row[k] for k in ("clientid", "request", "user", "parts", "begun", "ended")},
                   {"responses": row["responses"]})


REQUEST_ORDER = ("clientid", "request", "stream", "part")


def group_requests(rows: Iterable[dict]) -> Iterator[tuple[tuple, list[dict]]]:
    """Groups result rows sorted by REQUEST_ORDER, dropping repeated parts.

    An entity request and a schema request that reuse a client's request number stay apart.
    """
    key, parts, seen = None, [], set()
    for row in rows:
        k = (row["clientid"], row["request"], row.get("stream"))
        if k != key:
            if parts:
                yield key, parts
            key, parts, seen = k, [], set()
        if row["part"] not in seen:
            seen.add(row["part"])
            parts.append(row)
    if parts:
        yield key, parts


def split_complete(grouped: Iterable[tuple[tuple, list[dict]]], slice_key: str,
                   wait_slices: int | None = None) -> Iterator[tuple[str, dict]]:
    """Yields ("complete", row) for requests with every part, ("pending", part row) otherwise.

    Parts are distinct and none exceeds its own `parts` (validated), so as many parts as the
    largest count any of them gives are exactly parts 1..that count: a client that gave its
    parts different counts waits for the most it announced.

    With `wait_slices`, a request still incomplete `wait_slices` slices after the slice of its
    first part yields ("expired", what it got) instead: a client that died between its parts
    would otherwise keep its parts pending for good. Their results went out as partial responses.
    """
    for (clientid, request, _), parts in grouped:
        expected = max(p["parts"] for p in parts)
        if len(parts) >= expected:
            yield "complete", complete_row(sorted(parts, key=lambda r: r["part"]), slice_key)
        elif wait_slices is not None and int(slice_key) - min(int(p["slice"]) for p in parts) >= wait_slices:
            yield "expired", {"clientid": clientid, "request": request, "parts": expected,
                              "received": sorted(p["part"] for p in parts), "since": min(p["slice"] for p in parts)}
        else:
            for p in parts:
                yield "pending", p
