"""Schema learning: infer entity types from observed entity documents.

Runs distributed, so observations are kept in a mergeable `Summary` whose size
grows with the number of distinct field paths (to `MAX_PATHS`), never with the number of
documents: Spark tasks `observe` their rows, the driver `merge`s the partial
summaries and then the previous slice's summary (stored via `to_json`).

Schemas use the seed's style: a database schema document maps collection names
to entity types, an entity type is ``{"fields": {name: {"type": T,
"optional": bool}}}`` and a DOCUMENT field may carry nested ``"fields"``.

Decisions:

* Only DOCUMENT values are summarised recursively; ARRAY values are opaque
  (the seed's schema style has no element types).
* `infer` starts from the declared entity type and only *widens* it:
  required -> optional, INTEGER -> DOUBLE. A declared type that observations
  contradict (e.g. STRING declared, INTEGER seen) is kept, because the declared
  schema is authoritative; the contradiction is reported by `disagreements`.
* Reported paths are JSON Pointers without the leading slash ("phone/home"),
  escaped as in RFC 6901 so `patch.parse_path` reads them back.
* A whole number sent as `5.0` is an INTEGER (JSON, and JSON Schema's `integer`, do not tell
  them apart); a declared type the learner does not know (`UUID`, `DATE`) admits any value, and
  a field spec with nested `fields` but no type is a DOCUMENT.

Pure stdlib (and the pure `patch`): it is imported by Spark tasks and by the driver alike.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from entity_assets.patch import escape_token, shown

__all__ = [
    "TYPES",
    "type_of",
    "normalize_type",
    "Summary",
    "infer",
    "disagreements",
    "entity_types",
]

TYPES = ("STRING", "INTEGER", "DOUBLE", "BOOLEAN", "DOCUMENT", "ARRAY", "NULL")
STRING, INTEGER, DOUBLE, BOOLEAN, DOCUMENT, ARRAY, NULL = TYPES
_RANK = {t: i for i, t in enumerate(TYPES)}

_SYNONYMS = {
    **{t: t for t in TYPES},
    "LONG": INTEGER,
    "INT": INTEGER,
    "FLOAT": DOUBLE,
    "NUMBER": DOUBLE,
    "BOOL": BOOLEAN,
    "OBJECT": DOCUMENT,
    "MAP": DOCUMENT,
    "LIST": ARRAY,
    # Kafka Connect's schema types
    **dict.fromkeys(("INT8", "INT16", "INT32", "INT64"), INTEGER),
    "FLOAT32": DOUBLE,
    "FLOAT64": DOUBLE,
    "STRUCT": DOCUMENT,
}

_FORMAT = 1  # version of the to_json layout, checked by from_json

MAX_FIELDS = 1_000
"""Field names of a level that a learned type shows (the smallest): past them it says
`fieldsTruncated` (a document used as a map, a key per id, is no entity type's field list)."""
MAX_PATHS = 10_000
"""Field paths a summary keeps: the shallowest, and the smallest names among those as deep; a
level that left names out says `truncated` (a map of maps made a million paths, a 43 MB row)."""
_LONG = 2.0**63  # a whole number sent as a float is an INTEGER within a 64-bit integer's range


def type_of(value: Any) -> str:
    """The schema type of a JSON value (bool is tested before int: bool is an int subclass)."""
    if value is None:
        return NULL
    if isinstance(value, bool):
        return BOOLEAN
    if isinstance(value, int):  # past 64 bits no consumer's long holds it: as a float would be
        return INTEGER if -_LONG <= value < _LONG else DOUBLE
    if isinstance(value, float):
        return INTEGER if value.is_integer() and -_LONG <= value < _LONG else DOUBLE
    if isinstance(value, str):
        return STRING
    if isinstance(value, dict):
        return DOCUMENT
    if isinstance(value, (list, tuple)):
        return ARRAY
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def normalize_type(name: Any) -> str | None:
    """Canonical type name for a declared type (any case, common synonyms); unknown names upper-cased.

    None when there is no usable name, so a malformed declaration never masquerades as a type.
    """
    if not isinstance(name, str) or not name.strip():
        return None
    key = name.strip().upper()
    return _SYNONYMS.get(key, key)


# ---------------------------------------------------------------- summaries


class _Field:
    """Observations of one field name at one level: presence, type counts, nested documents."""

    __slots__ = ("present", "types", "doc")

    def __init__(self) -> None:
        self.present = 0  # documents (of the parent level) having this field
        self.types: dict[str, int] = {}  # type -> documents where the value had it
        self.doc: Summary | None = None  # the DOCUMENT values, summarised; created on first one

    def copy(self) -> _Field:
        """Deep copy, so merging never aliases another summary's mutable state."""
        f = _Field()
        f.present = self.present
        f.types = dict(self.types)
        f.doc = Summary()._add(self.doc) if self.doc is not None else None
        return f

    def merge(self, other: _Field) -> None:
        self.present += other.present
        for t, n in other.types.items():
            self.types[t] = self.types.get(t, 0) + n
        if other.doc is not None:
            if self.doc is None:
                self.doc = Summary()
            self.doc._add(other.doc)

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"present": self.present, "types": dict(self.types)}
        if self.doc is not None and self.doc.observed:
            d["doc"] = self.doc._dict()
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> _Field:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object")
        f = cls()
        f.present = _count(d.get("present"), f"{where}.present")
        types = d.get("types", {})
        if not isinstance(types, dict):
            raise ValueError(f"{where}.types: expected an object")
        for t, n in types.items():
            if t not in _RANK:
                raise ValueError(f"{where}.types: unknown type {t!r}")
            f.types[t] = _count(n, f"{where}.types.{t}")
        if "doc" in d:
            f.doc = Summary._from_dict(d["doc"], f"{where}.doc")
        return f


def _count(n: Any, where: str) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{where}: expected a non-negative integer, got {n!r}")
    return n


class Summary:
    """Mergeable observations of one collection's documents.

    Per field name: how many documents have it, how many had each type, and a nested
    Summary of its DOCUMENT values (to any depth). Merging is plain addition of counts,
    hence associative and commutative, so Spark partials can be combined in any order; then
    the `MAX_PATHS` first paths are kept (`_trim`), whatever the order.
    """

    __slots__ = ("observed", "fields", "truncated", "_grown")

    def __init__(self) -> None:
        self.observed = 0
        self.fields: dict[str, _Field] = {}
        self.truncated = False  # names of this level were left out (`_trim`)
        self._grown = 0  # paths `observe` added since the last `_trim`

    def _trim(self) -> None:
        """Keeps the `MAX_PATHS` first paths, shallowest first, then by name: a document used as a
        map of maps (a key per user, then per item) made a summary, and a learned type, of every
        path any client sent, which each learning slice read and rewrote. The order is the paths',
        so a path kept in the end is among the first of every subset of the paths: no partial
        dropped its counts, and partials merge to the same summary in any order. A level's names
        kept are its smallest. Trimmed past twice the bound, so a document of many paths costs a
        sort per bound."""
        budget, level = MAX_PATHS, [self]
        while level:
            deeper = []
            for s in level:
                if len(s.fields) > budget:
                    s.fields = {name: s.fields[name] for name in sorted(s.fields)[:budget]}
                    s.truncated = True
                budget -= len(s.fields)
                deeper.extend(f.doc for _, f in sorted(s.fields.items()) if f.doc is not None)
            level = deeper
        self._grown = 0

    @classmethod
    def of(cls, docs) -> Summary:
        """The summary of documents at hand: `infer(Summary.of(docs))` is their entity type (the
        steps `observe` theirs as they read them)."""
        s = cls()
        for doc in docs:
            s.observe(doc)
        return s

    def observe(self, doc: dict) -> None:
        """Count one document (an entity representation, e.g. an entity-updates ``after``)."""
        if not isinstance(doc, dict):
            raise TypeError(f"expected a document (dict), got {type(doc).__name__}")
        self._grown += self._observe(doc)
        if self._grown > MAX_PATHS:
            self._trim()

    def _observe(self, doc: dict) -> int:
        """Counts `doc` in this level and those below it; returns the paths it added."""
        self.observed += 1
        added = 0
        for name, value in doc.items():
            f = self.fields.get(name)
            if f is None:
                f = self.fields[name] = _Field()
                added += 1
            f.present += 1
            t = type_of(value)
            f.types[t] = f.types.get(t, 0) + 1
            if t == DOCUMENT:
                if f.doc is None:
                    f.doc = Summary()
                added += f.doc._observe(value)
        return added

    def shown(self) -> tuple[dict[str, _Field], bool]:
        """The level's `MAX_FIELDS` smallest names, and whether it has others, or left some out."""
        if len(self.fields) <= MAX_FIELDS:
            return self.fields, self.truncated
        return {name: self.fields[name] for name in sorted(self.fields)[:MAX_FIELDS]}, True

    def merge(self, other: Summary) -> Summary:
        """Add other's observations into self (other is left untouched and never aliased); returns self."""
        if not isinstance(other, Summary):
            raise TypeError(f"cannot merge {type(other).__name__} into Summary")
        self._add(other)
        self._trim()
        return self

    def _add(self, other: Summary) -> Summary:
        """Adds other's counts into this level and those below it, trimming none."""
        if other is self:
            other = Summary()._add(self)
        self.observed += other.observed
        self.truncated |= other.truncated
        for name, f in other.fields.items():
            mine = self.fields.get(name)
            if mine is None:
                self.fields[name] = f.copy()
            else:
                mine.merge(f)
        return self

    def to_dict(self) -> dict:
        self._trim()
        return self._dict()

    def _dict(self) -> dict:
        return {"observed": self.observed, "fields": {n: f.to_dict() for n, f in self.fields.items()},
                **({"truncated": True} if self.truncated else {})}

    def to_json(self) -> str:
        """Compact JSON with sorted keys: equal summaries give byte-identical text."""
        d = {"format": _FORMAT, **self.to_dict()}
        return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> Summary:
        """Inverse of to_json; ValueError on anything else (a corrupt stored summary must not merge silently)."""
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            raise ValueError(f"not a learning summary (format {_FORMAT})")
        s = cls._from_dict(d, "summary")
        s._trim()
        return s

    @classmethod
    def _from_dict(cls, d: Any, where: str) -> Summary:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object")
        s = cls()
        s.observed = _count(d.get("observed"), f"{where}.observed")
        fields = d.get("fields", {})
        if not isinstance(fields, dict):
            raise ValueError(f"{where}.fields: expected an object")
        for name, fd in fields.items():
            s.fields[name] = _Field.from_dict(fd, f"{where}.fields.{name}")
        s.truncated = d.get("truncated") is True
        return s

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Summary) and self.to_dict() == other.to_dict()

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"Summary(observed={self.observed}, fields={sorted(self.fields)})"


# ---------------------------------------------------------------- inference


def _non_null(types: dict[str, int]) -> dict[str, int]:
    return {t: n for t, n in types.items() if t != NULL and n > 0}


def _resolve(types: dict[str, int]) -> tuple[str, bool]:
    """(type, conflicting) for observed type counts without a declared type.

    NULL alone -> NULL; NULL with T -> T; INTEGER+DOUBLE -> DOUBLE; otherwise the most
    frequent (numbers counted together), ties broken by TYPES order, flagged as a conflict.
    """
    seen = _non_null(types)
    if not seen:
        return NULL, False
    groups: dict[str, int] = {}
    numeric = DOUBLE if DOUBLE in seen else INTEGER
    for t, n in seen.items():
        key = numeric if t in (INTEGER, DOUBLE) else t
        groups[key] = groups.get(key, 0) + n
    best = min(groups, key=lambda t: (-groups[t], _RANK.get(t, len(TYPES))))
    return best, len(groups) > 1


def _compatible(observed: str, declared: str) -> bool:
    return observed == declared or (observed == INTEGER and declared == DOUBLE) or declared not in _RANK


def _declared_type(spec: dict) -> str | None:
    """A field spec's type: its name, or DOCUMENT when it names none but lists nested fields."""
    t = normalize_type(spec.get("type"))
    return DOCUMENT if t is None and isinstance(spec.get("fields"), dict) else t


def _declaration_errors(schema_doc: Any) -> list[tuple[str | None, str, str]]:
    """What makes a database schema document not the seed's style: learning would read
    `"optional": "false"` as a field that may be missing, and skip a field spec that is not an
    object. A null `type` or `optional` counts as absent. Each error as (entity type, its path
    from the type's `fields` on, what is wrong there)."""
    if not isinstance(schema_doc, dict):
        return [(None, "", "a database schema must be an object of entity types")]
    errors, todo = [], [(n, "fields", et.get("fields")) for n, et in schema_doc.items() if isinstance(et, dict)]
    while todo:
        type_name, path, fields = todo.pop()
        if fields is None:
            continue
        if not isinstance(fields, dict):
            errors.append((type_name, path, "must be an object of field specs"))
            continue
        for name, spec in fields.items():
            where = f"{path}/{escape_token(name)}"
            if not isinstance(spec, dict):
                errors.append((type_name, where, "a field spec must be an object, such as "
                                                 "{\"type\": \"STRING\", \"optional\": true}"))
                continue
            if spec.get("type") is not None and normalize_type(spec["type"]) is None:
                errors.append((type_name, f"{where}/type", "must be a type name, such as \"STRING\""))
            if spec.get("optional") is not None and not isinstance(spec["optional"], bool):
                errors.append((type_name, f"{where}/optional", "must be true or false"))
            todo.append((type_name, f"{where}/fields", spec.get("fields")))
    return errors


def new_declaration_error(before: Any, after: Any) -> str | None:
    """The first of `after`'s declaration errors that `before` (None: no schema yet) did not have:
    a schema patch that makes one fails (status 3); one a schema already held, from a release
    that did not check, neither fails the patches that leave it be (a type renamed by a `move`,
    unchanged, keeps its errors) nor hides a new one."""
    held = Counter(_declaration_errors(before)) if before is not None else Counter()
    if isinstance(before, dict) and isinstance(after, dict):
        removed = [spec for name, spec in before.items() if name not in after]
        for name, spec in after.items():
            if name not in before and spec in removed:
                held.update((name, where, what) for _, where, what in _declaration_errors({name: spec}))
    for found in _declaration_errors(after):
        if held[found] > 0:
            held[found] -= 1
        else:
            type_name, where, what = found
            return f"{shown(_path(type_name, where))}: {what}" if where or type_name is not None else what
    return None


def _path(type_name: str | None, where: str) -> str:
    return where if type_name is None else f"{_top(type_name)}/{where}"


def _top(name: str) -> str:
    """A top-level name as a path's first token: an empty one keeps the path's leading slash,
    which `patch.parse_path` would otherwise drop (`/b` reads as `b`, `""` as the document)."""
    return escape_token(name) or "/"


def _fields_of(entity_type: Any) -> dict[str, dict] | None:
    """The field specs of an entity type or DOCUMENT field, or None when it lists none."""
    if not isinstance(entity_type, dict):
        return None
    fields = entity_type.get("fields")
    if not isinstance(fields, dict):
        return None
    return {n: spec for n, spec in fields.items() if isinstance(spec, dict)}


def _declared_spec(spec: dict) -> dict:
    """A declared field spec in canonical form, as kept when nothing observed changes it."""
    out: dict[str, Any] = {}
    t = _declared_type(spec)
    out["type"] = NULL if t is None else t  # declared without a type, never seen: as an undeclared one
    out["optional"] = spec.get("optional") is True
    nested = _fields_of(spec)
    if (t == DOCUMENT or t not in _RANK) and nested is not None:  # a type learning does not know keeps what it lists
        out["fields"] = {n: _declared_spec(nested[n]) for n in sorted(nested)}
    return out


def _left_out(cut: bool, last: str | None, name: str) -> bool:
    """Whether `name` may be one a level left out, past its last name shown: its counts, or their
    absence, say nothing."""
    return cut and (last is None or name > last)


def _infer_fields(level: Summary | None, declared: dict[str, dict] | None) -> dict[str, dict]:
    declared = declared or {}
    observed_fields, cut = level.shown() if level is not None else ({}, False)
    last = max(observed_fields, default=None)
    total = level.observed if level is not None else 0
    out: dict[str, dict] = {}
    for name in sorted(set(declared) | set(observed_fields)):
        f = observed_fields.get(name)
        spec = declared.get(name)
        if f is None or f.present == 0:
            entry = _declared_spec(spec) if spec is not None else {"type": NULL, "optional": True}
            if total and not _left_out(cut, last, name):  # observed documents at this level all lack it
                entry["optional"] = True
            out[name] = entry
            continue
        optional = f.present < total or f.types.get(NULL, 0) > 0
        dtype = _declared_type(spec) if spec is not None else None
        if dtype is None or dtype == NULL:
            t, _ = _resolve(f.types)
        elif dtype == INTEGER and f.types.get(DOUBLE, 0) > 0:
            t = DOUBLE  # the one type widening observations may force on a declaration
        else:
            t = dtype  # compatible, or contradicted: the declaration wins, disagreements() reports it
        entry = {"type": t, "optional": optional or (spec is not None and spec.get("optional") is True)}
        if t == DOCUMENT:
            nested = _fields_of(spec) if dtype == DOCUMENT else None
            if f.doc is not None or nested is not None:
                entry["fields"] = _infer_fields(f.doc, nested)
            if f.doc is not None and f.doc.shown()[1]:
                entry["fieldsTruncated"] = True
        elif t not in _RANK and (nested := _fields_of(spec)) is not None:
            entry["fields"] = {n: _declared_spec(nested[n]) for n in sorted(nested)}
        out[name] = entry
    return out


def infer(summary: Summary, declared: dict | None = None) -> dict:
    """The learned entity type: the declared one, widened by and extended with the observations.

    Widening only: required -> optional (a document lacked the field or had NULL), INTEGER ->
    DOUBLE; undeclared observed fields are added. Deterministic: fields sorted by name.
    """
    summary._trim()
    return {"fields": _infer_fields(summary, _fields_of(declared)),
            **({"fieldsTruncated": True} if summary.shown()[1] else {})}


# ---------------------------------------------------------------- disagreements


def _counts(types: dict[str, int]) -> str:
    return ", ".join(f"{t}×{types[t]}" for t in sorted(types, key=lambda t: _RANK.get(t, len(TYPES))))


def _disagree(level: Summary, declared: dict[str, dict] | None, prefix: str, out: list[dict]) -> None:
    total = level.observed
    shown, cut = level.shown()
    last = max(shown, default=None)
    for name, f in shown.items():
        if f.present == 0:
            continue
        path = prefix + escape_token(name) if prefix else _top(name)
        spec = (declared or {}).get(name)
        if spec is None:
            detail = f"observed in {f.present} of {total} documents as {_counts(f.types)}"
            if _resolve(f.types)[1]:
                detail += " (conflicting types)"
            out.append({"path": path, "kind": "undeclared", "detail": detail})
            continue
        dtype = _declared_type(spec)
        optional = spec.get("optional") is True
        if dtype not in (None, NULL):  # a NULL declared is no constraint: `infer` learns the field's type, as for none
            bad = {
                t: n for t, n in f.types.items()
                if n > 0 and not _compatible(t, dtype) and not (t == NULL and optional)
            }
            if bad:
                out.append({
                    "path": path,
                    "kind": "type_conflict",
                    "detail": f"declared {dtype} {'optional' if optional else 'required'}, "
                              f"observed {_counts(bad)} among {f.present} values",
                })
        if dtype == DOCUMENT and f.doc is not None:
            nested = _fields_of(spec)
            if nested is not None:  # a DOCUMENT declared without fields is unconstrained inside
                _disagree(f.doc, nested, path + "/", out)
    if total:
        for name, spec in (declared or {}).items():
            if spec.get("optional") is True:
                continue
            f = shown.get(name)
            missing = total - (f.present if f is not None else 0)
            if missing > 0 and not _left_out(cut, last, name):
                out.append({
                    "path": prefix + escape_token(name) if prefix else _top(name),
                    "kind": "required_missing",
                    "detail": f"missing in {missing} of {total} documents",
                })


def disagreements(summary: Summary, declared: dict | None) -> list[dict]:
    """Where observed documents disagree with the declared entity type, sorted by (path, kind).

    undeclared: top-most undeclared path only; type_conflict: observed types the declaration
    does not admit (INTEGER fits DOUBLE, NULL fits optional); required_missing: with counts.
    """
    out: list[dict] = []
    summary._trim()
    _disagree(summary, _fields_of(declared) or {}, "", out)
    return sorted(out, key=lambda d: (d["path"], d["kind"]))


def entity_types(schema_doc: dict | None) -> dict[str, dict]:
    """Collection name -> entity type of a database schema document (non-dict entries ignored).

    Also reads a schema-learning entity-type message's ``after`` (a one-collection schema).
    """
    if not isinstance(schema_doc, dict):
        return {}
    return {name: et for name, et in schema_doc.items() if isinstance(et, dict)}
