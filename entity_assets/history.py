"""An entity's history: its versions replayed from `entity_updates`, readable as of any slice or time.

`entities` holds each entity as it is now, and Delta keeps its older versions only for
`lake_maintenance`'s retention. `entity_updates` keeps every successful patch for good, with its
ops, in slice files that are never rewritten, and a patch that failed (status 2 or 3) changed
nothing. So replaying an entity's updates in the fold's order (slice, then `core.ORDER`) through
the patch engine gives every version it had: version v is the document after its v-th update.

A version is valid from its patch's `ended` until the next version's start (the data hub seed's
valid_from/valid_to). Messages may arrive out of `begun` order across slices, and a version holds
every change before it, so it starts when all of them had ended: the running maximum of `ended`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable

import pyarrow.compute as pc

from entity_assets import core
from entity_assets.patch import STATUS_OK
from entity_assets.slices import slice_key
from entity_assets.storage import DeltaRsEngine, read_tables
from entity_assets.tables import SCHEMAS

COLUMNS = ["slice", "kafka_topic", "kafka_partition", "kafka_offset", *core.ORDER, "ended", "ops", "action"]
"""The `entity_updates` columns a replay reads."""


class Diverged(Exception):
    """An update that does not apply to the version before it: `entity_updates` lacks one of the
    entity's updates (a slice's files deleted by hand), or was written by other code."""


def versions(updates: Iterable[dict]) -> list[dict]:
    """One entity's `entity_updates` rows (any order, `COLUMNS` at least) -> its versions, oldest
    first: version, valid_from, valid_to (None for the current one), deleted, document, and the
    update that made it (slice, action, ended, request identity, Kafka coordinates)."""
    state, out, start = core.DocState(), [], None
    for u in sorted(updates, key=lambda u: (u["slice"], *(u[c] for c in core.ORDER))):
        status, error, _, _, action = core.apply(state, u["ops"], u["ended"], False, False)
        if status != STATUS_OK or action != u["action"]:
            raise Diverged(f"update {u['clientid']}/{u['request']}/{u['part']} of slice {u['slice']} gives status "
                           f"{status} ({error}), action {action}, where entity_updates says it was applied "
                           f"({u['action']}): the table is missing an earlier update of this entity")
        start = u["ended"] if start is None else max(start, u["ended"])
        out.append({"version": state.version, "valid_from": start, "valid_to": None, "deleted": state.doc is None,
                    "document": state.doc, **{c: u[c] for c in COLUMNS if c != "ops"}})
    for older, newer in zip(out, out[1:]):
        older["valid_to"] = newer["valid_from"]
    return out


def as_of(history: list[dict], *, slice: int | None = None, time: int | None = None) -> dict | None:
    """The version current after slice number `slice`, or at `time` (ms, valid_from <= time <
    valid_to), or now; None before the entity's first version."""
    last, found = None if slice is None else slice_key(slice), None
    for v in history:  # valid_from never decreases, and slices are in order
        if (last is not None and v["slice"] > last) or (time is not None and v["valid_from"] > time):
            break
        found = v
    return found


def entity_history(engine: DeltaRsEngine, dbid: str, collection: str, zone: str, entity: str) -> list[dict]:
    """`versions` of one entity, read from every slice of `entity_updates`: of each file, only the
    row groups that the statistics of `bucket` admit (a file's rows are in bucket order), all of
    a file written before the column was added (`tables.ADDED_IN_PLACE`)."""
    if not engine.exists("entity_updates"):
        return []
    key = (dbid, collection, zone, entity)
    bucket = pc.field("bucket")
    where = functools.reduce(operator.and_, (pc.field(c) == v for c, v in zip(core.ENTITY_KEY, key)),
                             (bucket == core.bucket_of(*key)) | bucket.is_null())
    return versions(r for t in read_tables(engine.files("entity_updates"), engine.storage_options, COLUMNS, where,
                                           SCHEMAS["entity_updates"])
                    for r in t.to_pylist())
