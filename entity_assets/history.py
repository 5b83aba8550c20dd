"""An entity's history: its versions replayed from `entity_updates`, readable as of any slice or time.

`entities` holds each entity as it is now, and Delta keeps its older versions only for
`lake_maintenance`'s retention. `entity_updates` keeps every successful patch for good, with its
ops, in slice files that are never rewritten, and a patch that failed (status 2 or 3) changed
nothing. So replaying an entity's updates in the fold's order (slice, then `core.ORDER`) through
the patch engine gives every version it had: version v is the document after its v-th update.

A version is valid from its patch's `ended` until the next version's start. Slice order wins, as
in the fold (not the data hub seed's effective-time order): messages may arrive out of `begun`
order across slices, and a version holds every change before it, so it starts when all of them
had ended, the running maximum of `ended`. A version whose next update had ended by then is valid
from t to t: a state of the fold that no time reads (its slice does, where it is the slice's last).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable

import pyarrow.compute as pc

from entity_assets import core
from entity_assets.patch import STATUS_OK
from entity_assets.slices import slice_key, slice_seq
from entity_assets.storage import DeltaRsEngine, read_tables
from entity_assets.tables import SCHEMAS

COLUMNS = ["slice", "kafka_topic", "kafka_partition", "kafka_offset", *core.ORDER, "ended", "ops", "action"]
"""The `entity_updates` columns a replay reads."""
INDEXED = [*COLUMNS, "bucket", "previousSlice"]
"""And those `entity_history` follows from slice to slice."""


class Diverged(Exception):
    """An update that does not apply to the version before it, or a history that does not reach the
    entity's row in `entities`: `entity_updates` lacks some of the entity's updates (a slice's
    files deleted by hand, a run that failed between its commits), or was written by other code."""


def versions(updates: Iterable[dict]) -> list[dict]:
    """One entity's `entity_updates` rows (any order, `COLUMNS` at least) -> its versions, oldest
    first: version, valid_from, valid_to (None for the current one), deleted, document, and the
    update that made it (slice, action, ended, request identity, Kafka coordinates)."""
    state, out, start = core.DocState(), [], None
    for u in sorted(updates, key=lambda u: (u["slice"], *(u[c] for c in core.ORDER))):
        status, error, _, _, action = core.apply(state, u["ops"], u["ended"], False, False, sized=False)
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
    """`versions` of one entity, read from the slices of `entity_updates` that changed it.

    Its row in `entities` names the last such slice, and each update the one before
    (`previousSlice`), so a history reads as many slices as changed the entity, whatever the
    lake's age, and of their files only the row groups whose `bucket` statistics admit it. Where
    that chain breaks (updates written before the index columns were added in place), it reads
    every slice before the break instead. A history that does not end at the entity's row in
    `entities` (that slice's updates missing) is `Diverged`.
    """
    if not engine.exists("entity_updates"):
        return []
    key, bucket = (dbid, collection, zone, entity), core.bucket_of(dbid, collection, zone, entity)
    column = pc.field("bucket")
    where = functools.reduce(operator.and_, (pc.field(c) == v for c, v in zip(core.ENTITY_KEY, key)),
                             (column == bucket) | column.is_null())

    def read(files) -> list[dict]:
        return [u for t in read_tables(files, engine.storage_options, INDEXED, where, SCHEMAS["entity_updates"])
                for u in t.to_pylist()]

    state = engine.state_rows("entities", core.ENTITY_KEY, {key}, [bucket])
    updates, at = [], state[0]["slice"] if state else None
    files_of = engine.slice_finder("entity_updates")  # an entity may have changed in thousands of slices
    while at is not None:
        found = read(files_of(at))
        updates += found
        if not found or found[0]["bucket"] is None:
            older = [f for f in engine.files("entity_updates") if f.min.get("slice", "") < at]  # no later file
            return _reaching(versions(updates + [u for u in read(older) if u["slice"] < at]), state[0])
        at = found[0]["previousSlice"]
    return _reaching(versions(updates), state[0]) if state else versions(read(engine.files("entity_updates")))


def _reaching(history: list[dict], now: dict) -> list[dict]:
    """`history`, which must end at the entity's row in `entities`: where a slice's updates are
    missing (a read between apply_patches' commit of `entities` and its commit of
    `entity_updates`, or a run that failed between them), the replay of the slices before it
    would end versions short, with nothing to say so."""
    last = history[-1] if history else {"version": 0, "slice": None}
    if (last["version"], last["slice"]) != (now["version"], now["slice"]):
        raise Diverged(f"entity_updates lacks slice {now['slice']}'s updates of this entity, whose row in entities "
                       f"is version {now['version']} of that slice (the history replayed ends at version "
                       f"{last['version']}): re-run slice {slice_seq(now['slice'])}, or read again once its run ended")
    return history
