"""Message texts of many rows at once, built by Arrow kernels: the same text as `core`'s per-row
encoders (`result_json`), without making each row a dict first.

A task that publishes rows it holds in Arrow (zone_changes publishes entity_updates again) spent about
half its CPU turning rows into dicts and JSON one by one. Here one join per row of literal
pieces and value columns makes the message. Strings that JSON must escape (quotes,
backslashes, control characters: rare in ids) are encoded by `core.dumps` one by one, so the
text is always what the per-row encoder gives.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from entity_assets import core
from entity_assets.patch import JSON_ESCAPED
from entity_assets.storage import one_array


def _needs_escape(values: pa.Array) -> bool:
    """Whether some string holds a character JSON escapes: numpy's comparisons over the bytes of
    all of them at once (a regular expression's scan of the same bytes takes 20 times as long)."""
    data = values.buffers()[2]
    if data is None:
        return False
    codes = np.frombuffer(data, np.uint8)
    return bool((codes < 0x20).any() or (codes == ord('"')).any() or (codes == ord("\\")).any())


def _string(values: pa.Array | pa.ChunkedArray) -> list:
    """Pieces of a join that give each string's JSON text: the quotes around the strings as they
    are when none is null or needs escaping (the rule), else the JSON texts made one by one."""
    values = one_array(values).cast(pa.string())
    escaping = _needs_escape(values)
    if not values.null_count and not escaping:
        return ['"', values, '"']
    quoted = pc.binary_join_element_wise('"', values, '"', "")
    if escaping:
        escape = pc.fill_null(pc.match_substring_regex(values, JSON_ESCAPED.pattern), False)
        slow = pa.array([core.dumps(v) if e else None for v, e in zip(values.to_pylist(), escape.to_pylist())],
                        pa.string())
        quoted = pc.if_else(escape, slow, quoted)
    return [pc.fill_null(quoted, "null")]


def _value(values: pa.Array | pa.ChunkedArray) -> list:
    """Pieces of each value's JSON text, a string or an integer (null: `null`)."""
    return _string(values) if pa.types.is_string(values.type) else [_number(values)]


def _number(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Each integer as its JSON text (null: `null`)."""
    return pc.fill_null(pc.cast(one_array(values), pa.string()), "null")


def _member(name: str, pieces: list, where: pa.Array | None = None) -> list:
    """Pieces of `,"name":<value>` on the rows `where` holds (all when None), "" on the others."""
    if where is None:
        return [f',"{name}":', *pieces]
    return [pc.if_else(pc.fill_null(where, False), pc.binary_join_element_wise(f',"{name}":', *pieces, ""), "")]


def _optional(name: str, values: pa.Array | pa.ChunkedArray, pieces: list) -> list:
    """The member where `values` is not null: inline when none is."""
    return _member(name, pieces, pc.is_valid(values) if values.null_count else None)


def _flag(name: str, values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """`,"name":true` where the flag is set, "" elsewhere (a false or null flag is left out)."""
    return pc.if_else(pc.fill_null(one_array(values), False), f',"{name}":true', "")


def result_texts(rows: pa.Table) -> pa.Array:
    """`core.result_json` of every row of `rows` (columns by name, as in the result tables).

    One join per row of literal pieces and value columns; optional members are "" where absent.
    """
    if not rows.num_rows:
        return pa.array([], pa.string())
    col, names = rows.column, rows.column_names
    ok = pc.fill_null(pc.equal(col("status"), core.STATUS_OK), False)
    pieces = _members(rows, ("dbid", "db", "clientid", "request", "user"))
    for name in ("collection", "zone", "entity", "parts", "part", "begun"):
        if name in names:
            values = col(name)
            if name == "collection" and "kind" in names:  # an entity type's is its row's, not its message's
                values = pc.if_else(pc.fill_null(pc.equal(one_array(col("kind")), core.ENTITY_TYPE), False), None,
                                    one_array(values))
            pieces += _optional(name, values, _value(values))
    pieces += [',"status":', _number(col("status")), ',"ended":', _number(col("ended"))]
    if "learning" in names:
        pieces.append(_flag("learning", col("learning")))
    pieces += [_flag("includeBefore", col("includeBefore")), _flag("includeAfter", col("includeAfter"))]
    if "error" in names:  # schema_learning has none: its rows are all status 1
        pieces += _member("error", _string(col("error")), pc.invert(ok))
    pieces += [*_optional("ops", col("ops"), [one_array(col("ops"))]),
               *_member("before", [pc.fill_null(one_array(col("before")), "null")], _before_asked(rows, ok)),
               *_member("after", [pc.fill_null(one_array(col("after")), "null")], pc.and_(ok, _after_asked(rows))),
               "}"]
    return pc.binary_join_element_wise(*pieces, "")


def _before_asked(rows: pa.Table, ok: pa.Array) -> pa.Array:
    """Applied, and requested by the request; never in an entity type's schema-learning message."""
    asked = pc.and_(ok, pc.fill_null(one_array(rows.column("includeBefore")), False))
    if "kind" not in rows.column_names:
        return asked
    return pc.and_(asked, pc.invert(pc.fill_null(pc.equal(one_array(rows.column("kind")), core.ENTITY_TYPE), False)))


def _after_asked(rows: pa.Table) -> pa.Array:
    """Requested by the request, or a schema-learning row (a `kind`), which always carries `after`."""
    asked = pc.fill_null(one_array(rows.column("includeAfter")), False)
    return pc.or_(asked, pc.is_valid(rows.column("kind"))) if "kind" in rows.column_names else asked


def complete_texts(rows: pa.Table) -> pa.Array:
    """`core.complete_json` of every complete_responses row of `rows`."""
    return object_texts(rows, ("clientid", "request", "user", "parts", "begun", "ended"), documents=("responses",))


def patch_texts(rows: pa.Table) -> pa.Array:
    """`core.patch_json` of every entity_patches row of `rows`."""
    return object_texts(rows, ("clientid", "request", "user", "collection", "zone", "entity", "parts", "part", "begun"),
                        flags=("learning", "includeBefore", "includeAfter"), documents=("ops",), database=True)


def object_texts(rows: pa.Table, names: tuple[str, ...], *, flags: tuple[str, ...] = (),
                 documents: tuple[str, ...] = (), database: bool = False) -> pa.Array:
    """Per row, the JSON object of the columns `names` (strings and integers, null as `null`),
    then `,"flag":true` for each of `flags` set, then `documents` (JSON text, spliced): what
    `core.dumps` (and `core._object` for documents) gives of the same members.

    `database`: `dbid` and its alias `db` come first, as in every message of a database.
    """
    if not rows.num_rows:
        return pa.array([], pa.string())
    pieces = _members(rows, (("dbid", "db") if database else ()) + names)
    pieces += [_flag(name, rows.column(name)) for name in flags]
    for name in documents:
        pieces += [f'{"," if pieces else "{"}"{name}":', pc.fill_null(one_array(rows.column(name)), "null")]
    return pc.binary_join_element_wise(*pieces, "}", "")


def _members(rows: pa.Table, names: tuple[str, ...]) -> list:
    """Pieces of `{"name":<value>,...` for columns every row has a value of (null: `null`);
    `db` is the `dbid` column under its alias."""
    pieces = []
    for i, name in enumerate(names):
        pieces += [f'{"," if i else "{"}"{name}":', *_value(rows.column("dbid" if name == "db" else name))]
    return pieces
