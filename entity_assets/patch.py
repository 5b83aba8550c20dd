"""JSON Patch (RFC 6902) over entity documents, with entity create/delete semantics.

Pure stdlib: it runs once per patch in a hot loop, so it never deep-copies.
Every op copies only the containers on the path it changes and shares every
other subtree with its input (and shares ``value`` objects taken from the ops).
Inputs are therefore never mutated, a failed patch leaves the caller holding
the untouched original, and results must be treated as immutable: mutating a
result in place can change the input document or the ops it came from.

Deliberate differences from RFC 6902:

* ``add`` creates missing parent *objects* (``add /baz/bat`` on ``{}`` gives
  ``{"baz": {"bat": ...}}``; RFC A.12 calls that an error). Missing array
  elements and non-container parents are still errors.
* Paths may omit the leading slash (``phone/home`` == ``/phone/home``).
* A document nests at most ``MAX_DEPTH`` containers (MongoDB's limit); an op
  that would nest deeper fails, so no document outgrows the JSON parsers that
  read it back, and no path outgrows the interpreter's recursion limit.
* ``copy`` shares the copied subtree, so each copy of a whole document doubles
  its text at no cost in memory until the document is written: thirty of them
  in a 2 KB message would make a gigabyte. A ``copy`` fails once the document's
  text would pass ``MAX_DOCUMENT_BYTES`` (MongoDB's limit too), measured with
  shared subtrees counted once, so the check never walks what it guards against.
* An insert or a remove before an array's end moves the rest of the array: a patch fails once
  its own have moved ``MAX_SHIFTS`` elements.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

__all__ = [
    "STATUS_OK",
    "STATUS_NOT_FOUND",
    "STATUS_FAILED",
    "MAX_DEPTH",
    "MAX_DOCUMENT_BYTES",
    "MAX_SHIFTS",
    "nesting",
    "PatchError",
    "PatchOutcome",
    "parse_path",
    "escape_token",
    "shown",
    "apply_ops",
    "apply_patch",
    "growth_bound",
]

STATUS_OK = 1  # patch applied
STATUS_NOT_FOUND = 2  # entity did not exist and the patch is not a creation
STATUS_FAILED = 3  # patch could not be applied (see error)
MAX_DEPTH = 100  # containers on a document's deepest path, the document itself included
MAX_DOCUMENT_BYTES = 16 * 1024 * 1024  # JSON text (characters) a patch may grow a document to: a copy here, any op in core
MAX_SHIFTS = 50_000_000
"""Array elements a patch's inserts and removes may move up or down (those after the index, about
15 ms): each shifts the rest of its array, and 26,666 inserts at the front of an array of 490,000
in one message took 4 s. Appends and removes at the end move none."""


class PatchError(Exception):
    """One op failed. Attributes: index (0-based op index), op (the op dict), reason (str)."""

    def __init__(self, index: int, op, reason: str):
        # args carry all three fields so the error survives pickling (multiprocess runs).
        super().__init__(index, op, reason)
        self.index = index
        self.op = op
        self.reason = reason

    def __str__(self) -> str:
        return f"op {self.index} ({_describe(self.op)}): {self.reason}"


@dataclass(frozen=True, slots=True)
class PatchOutcome:
    status: int  # STATUS_OK, STATUS_NOT_FOUND or STATUS_FAILED
    doc: dict | None  # new document; None when deleted; the unchanged input on 2/3
    error: str | None  # None when status == STATUS_OK
    deleted: bool  # the patch deleted the entity
    size: int | None = None  # on 1, given the input's: at least doc's text but its other ops' growth (`growth_bound`)


class _Fail(Exception):
    """Internal: an op-level failure, turned into a PatchError that knows the op index."""


def _describe(op) -> str:
    if not isinstance(op, dict):
        return f"<{type(op).__name__}>"
    parts = [str(op.get("op", "?"))[:40]]
    src, path = op.get("from"), op.get("path")
    if isinstance(src, str):
        parts.append(shown(src) + " ->")
    if isinstance(path, str):
        parts.append(shown(path))
    return " ".join(parts)


def _named(value) -> str:
    """A client's token, name or path in an error, quoted and cut: a failed patch's response
    stays a line, not a second copy of its request."""
    return shown(repr(value))


def shown(path: str, limit: int = 120) -> str:
    """A path (or a name) as errors and metadata show it: long ones are cut, so it stays a line,
    not a copy of the input."""
    if not path:
        return '""'
    return path if len(path) <= limit else path[:limit] + f"... ({len(path)} chars)"


# ---------------------------------------------------------------- paths


_BAD_ESCAPE = re.compile(r"~(?![01])")


CACHED_PATH_CHARS = 256
CACHED_PATH_TOKENS = 16
"""Paths the patch engine caches at most, in characters and in `/`s, each of `CACHED_PATHS`: a path
may be as long as a message, and each token is a string of its own (a 254-character path of 124
tokens outside Latin-1 held 11 KB). A slice of such paths kept 764 MB in a worker for good; cached
paths hold a few KB each at most, real ones far less."""
CACHED_PATHS = 4096


@functools.lru_cache(maxsize=CACHED_PATHS)
def parse_path(path: str) -> tuple[str, ...]:
    """Split a JSON Pointer into unescaped reference tokens.

    ``""`` is the whole document. A missing leading slash is implied, so
    ``"phone/home"`` and ``"/phone/home"`` are both ``("phone", "home")``.
    As in RFC 6901, ``"/"`` is *not* the root: it is the member named ``""``.
    ``~1`` decodes to ``/`` before ``~0`` decodes to ``~`` (``"~01"`` -> ``"~1"``);
    any other ``~`` sequence raises ValueError. Cached: the same paths repeat.
    """
    if not isinstance(path, str):
        raise ValueError(f"path must be a string, got {type(path).__name__}")
    if path == "":
        return ()
    raw = path[1:] if path[0] == "/" else path
    tokens = raw.split("/")
    if "~" in raw:
        if _BAD_ESCAPE.search(raw):
            raise ValueError(f"invalid '~' escape in path {_named(path)}")
        tokens = [t.replace("~1", "/").replace("~0", "~") for t in tokens]
    return tuple(tokens)


def escape_token(name: str) -> str:
    """A name as a JSON Pointer token (RFC 6901): its `/` cannot be taken for a separator."""
    return name.replace("~", "~0").replace("/", "~1")


def _index(token: str, size: int, end_ok: bool) -> int:
    """Array index for token; end_ok allows ``-`` and ``size`` (add targets only)."""
    if token == "-":
        if end_ok:
            return size
        raise _Fail("index '-' (past the end) is only valid as an add target")
    if not (token.isascii() and token.isdigit()) or (len(token) > 1 and token[0] == "0"):
        raise _Fail(f"invalid array index: {_named(token)}")
    # compared as digits first: int() refuses more than 4,300 of them (a ValueError, not the op's failure)
    if len(token) > len(str(size)) or int(token) > size or (int(token) == size and not end_ok):
        raise _Fail(f"index out of range: {token[:20]!r}{'...' if len(token) > 20 else ''} (array length {size})")
    return int(token)


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return {dict: "object", list: "array"}.get(type(value), type(value).__name__)


def nesting(value, limit: int) -> int:
    """Containers on the deepest path of ``value`` (a scalar has 0); stops counting past ``limit``.

    A subtree shared by copies is walked again only when reached at a deeper level.
    """
    if not isinstance(value, (dict, list)):
        return 0
    deepest, todo, reached = 1, [(value, 1)], {}
    while todo and deepest <= limit:
        node, level = todo.pop()
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)) and reached.get(id(child), 0) < level + 1:
                reached[id(child)] = level + 1
                deepest = max(deepest, level + 1)
                todo.append((child, level + 1))
    return deepest


JSON_ESCAPED = re.compile(r'["\\\x00-\x1f]')
"""Characters that JSON text escapes (`core.dumps`): at most 6 characters each (`\u0000`).
Its pattern is RE2's too (`encode`, in Arrow)."""


def _str_size(text: str) -> int:
    """At least the length of ``text`` as a JSON string: a client's control characters must not
    make a bound that a multi-gigabyte text passes."""
    size = len(text) + 2
    return size if JSON_ESCAPED.search(text) is None else size + 5 * len(JSON_ESCAPED.findall(text))


def _text_size(value, memo: dict) -> int:
    """At least the length of ``value`` as JSON text (an integer of 4,000 digits counts them all);
    memo (id -> (node, size)) measures a shared subtree once and keeps it alive, so its id is not
    reused while the memo is."""
    if isinstance(value, str):
        return _str_size(value)
    if value is None or isinstance(value, bool):
        return 5
    if isinstance(value, int):
        # digits (log10 of 2 < 0.30103) and a sign: 0 is its 1 digit, a 12 MB array of zeros not 18 MB
        return value.bit_length() * 30103 // 100000 + 1 + (value < 0)
    if isinstance(value, float):
        return len(repr(value))
    hit = memo.get(id(value))
    if hit is not None:
        return hit[1]
    if isinstance(value, dict):
        size = 2 + sum(_str_size(key) + 2 + _text_size(child, memo) for key, child in value.items())
    else:
        size = 2 + sum(_text_size(child, memo) + 1 for child in value)
    memo[id(value)] = (value, size)
    return size


class _Growth:
    """A patch's own state as its ops apply. What its copies have grown its document to: an upper
    bound on its text, up to the other ops' growth (`growth_bound`), from the input's size where the
    caller knows it (else measured at the first copy). A bound past the limit is measured again,
    which takes off what removes and overwrites took away, at most `MEASURES` times a patch: each
    measure walks the containers its ops made since the last. And the containers the patch made
    (`owned`), which its later ops change in place (`_own`)."""

    MEASURES = 8
    __slots__ = ("memo", "size", "measures", "depths", "owned", "shifts", "limited")

    def __init__(self, size: int | None, limited: bool = True) -> None:
        self.memo: dict = {}
        self.size = size
        self.measures = 0
        self.depths: dict[int, tuple] = {}  # id -> (container, its nesting): kept alive, so ids stay its
        self.owned: dict[int, dict | list] = {}  # id -> container: in the document once, the input's nowhere
        self.shifts = 0  # array elements the patch's inserts and removes moved (`MAX_SHIFTS`)
        self.limited = limited  # False: a replay of updates applied already, under an older release's rules

    def shift(self, count: int) -> None:
        """An insert or a remove is to move `count` elements of its array."""
        self.shifts += count
        if self.shifts > MAX_SHIFTS and self.limited:
            raise _Fail(f"the patch's inserts and removes would move over {MAX_SHIFTS} array elements")

    def disown(self, value) -> None:
        """`value` is to be held twice (a copy): neither it nor an owned container in it is changed
        in place from now on. Owned containers are only in owned ones (`_own` owns a whole spine),
        so the walk stops at the first that is not: a copy of a scalar or of the input's costs nothing."""
        stack = [value]
        while stack:
            node = stack.pop()
            if isinstance(node, (dict, list)) and self.owned.pop(id(node), None) is not None:
                stack.extend(node.values() if isinstance(node, dict) else node)

    def changed(self, node) -> None:
        """An owned container changes in place: what was measured of it no longer holds. Its
        ancestors are the edit's spine, each changed too."""
        self.memo.pop(id(node), None)
        self.depths.pop(id(node), None)

    def moved_within_depth(self, tokens: tuple[str, ...], src: tuple[str, ...], value) -> None:
        """`_within_depth` of a value the document holds at `src`: a target no deeper cannot nest
        the document deeper than it was, and a container's nesting is walked once a patch, so
        25,000 moves of one large subtree back and forth cost their paths, not its size each."""
        if len(tokens) <= len(src):
            return
        held = self.depths.get(id(value))
        if held is None and isinstance(value, (dict, list)):
            held = self.depths[id(value)] = (value, nesting(value, MAX_DEPTH))
        _within_depth(tokens, value, held and held[1])

    def copied(self, doc, tokens: tuple[str, ...], value) -> None:
        """After `value` was copied to `tokens`, making `doc`. A copy of a scalar into a document of
        known size walks nothing: measured at every copy, a 1 MB batch of one-op copies on a 1 MB
        document took 5 minutes."""
        if self.size is None or not tokens:
            self.size = _text_size(doc, self.memo)
        else:
            self.size += _text_size(value, self.memo) + _str_size(tokens[-1]) + 2
        if self.size > MAX_DOCUMENT_BYTES and self.measures < self.MEASURES:
            self.measures += 1
            self.size = _text_size(doc, self.memo)
        if self.size > MAX_DOCUMENT_BYTES:
            raise _Fail(f"the document would be over {MAX_DOCUMENT_BYTES} bytes of JSON")


def _within_depth(tokens: tuple[str, ...], value, nested: int | None = None) -> None:
    """A value put at ``tokens`` sits inside ``len(tokens)`` containers (the document's own
    included); `nested`: the value's nesting, where known."""
    if len(tokens) < MAX_DEPTH and not isinstance(value, (dict, list)):
        return  # a scalar at a shallow path: the common case, decided without walking anything
    if len(tokens) + (nesting(value, MAX_DEPTH - len(tokens)) if nested is None else nested) > MAX_DEPTH:
        raise _Fail(f"the document would nest deeper than {MAX_DEPTH} levels")


def _get(doc, tokens: tuple[str, ...]):
    node = doc
    for token in tokens:
        if isinstance(node, dict):
            if token not in node:
                raise _Fail(f"path not found: {_named(token)}")
            node = node[token]
        elif isinstance(node, list):
            node = node[_index(token, len(node), end_ok=False)]
        else:
            raise _Fail(f"cannot resolve {_named(token)} inside a {_kind(node)}")
    return node


def _own(node, growth: _Growth):
    """`node` to change: itself if this patch made it (no one else holds it), else a copy that the
    patch owns from now on. A patch of N ops on a container of W members then costs N + W, not
    N x W: 24,900 appends to an array of 490,000 in one message took 49 s."""
    if id(node) in growth.owned:
        growth.changed(node)
        return node
    new = dict(node) if isinstance(node, dict) else list(node)
    growth.owned[id(new)] = new
    return new


def _edit(node, tokens: tuple[str, ...], depth: int, leaf, arg, create: bool, growth: _Growth):
    """node with leaf(parent, key, arg, growth) applied at tokens; copies only the spine, once a patch."""
    token = tokens[depth]
    if depth == len(tokens) - 1:
        return leaf(node, token, arg, growth)
    if isinstance(node, dict):
        if token in node:
            child = node[token]
        elif create:
            child = {}
        else:
            raise _Fail(f"path not found: {_named(token)}")
        child = _edit(child, tokens, depth + 1, leaf, arg, create, growth)
        new = _own(node, growth)
        new[token] = child
        return new
    if isinstance(node, list):
        i = _index(token, len(node), end_ok=False)
        child = _edit(node[i], tokens, depth + 1, leaf, arg, create, growth)
        new = _own(node, growth)
        new[i] = child
        return new
    raise _Fail(f"cannot resolve {_named(token)} inside a {_kind(node)}")


def _leaf_add(parent, key, value, growth: _Growth):
    if isinstance(parent, dict):
        new = _own(parent, growth)
        new[key] = value
        return new
    if isinstance(parent, list):
        i = _index(key, len(parent), end_ok=True)
        if i < len(parent):
            growth.shift(len(parent) - i)
        new = _own(parent, growth)
        new.insert(i, value)
        return new
    raise _Fail(f"cannot add {_named(key)} to a {_kind(parent)}")


_REMOVED = object()
"""`_leaf_existing`'s value that removes the member (None is JSON's null, a value)."""


def _leaf_existing(parent, key, value, growth: _Growth):
    """`parent` with its member `key`, which must exist, replaced by `value` or `_REMOVED`."""
    if isinstance(parent, dict):
        if key not in parent:
            raise _Fail(f"path not found: {_named(key)}")
        at = key
    elif isinstance(parent, list):
        at = _index(key, len(parent), end_ok=False)
        if value is _REMOVED and at < len(parent) - 1:
            growth.shift(len(parent) - 1 - at)
    else:
        raise _Fail(f"cannot resolve {_named(key)} inside a {_kind(parent)}")
    new = _own(parent, growth)
    if value is _REMOVED:
        del new[at]
    else:
        new[at] = value
    return new


def _add(doc, tokens, value, growth: _Growth):
    return value if not tokens else _edit(doc, tokens, 0, _leaf_add, value, True, growth)


def _remove(doc, tokens, growth: _Growth):
    if not tokens:
        raise _Fail("removing the whole document is only allowed as an entity deletion")
    return _edit(doc, tokens, 0, _leaf_existing, _REMOVED, False, growth)


def json_equal(a, b) -> bool:
    """RFC 6902 equality: 1 == 1.0, but booleans never equal numbers (Python says True == 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a is b
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(json_equal(v, b[k]) for k, v in a.items())
        )
    if isinstance(a, list):
        return (
            isinstance(b, list)
            and len(a) == len(b)
            and all(json_equal(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, (int, float)):
        return isinstance(b, (int, float)) and a == b
    if isinstance(a, str):
        return isinstance(b, str) and a == b
    return a is None and b is None


# ---------------------------------------------------------------- ops


def _tokens(op: dict, key: str) -> tuple[str, ...]:
    if key not in op:
        raise _Fail(f"missing {key!r}")
    path = op[key]
    if not isinstance(path, str):
        raise _Fail(f"{key!r} must be a string, got {_kind(path)}")
    try:
        chars = len(path)  # a path of 16 characters has 16 tokens at most: most are not counted
        cached = chars <= CACHED_PATH_TOKENS or chars <= CACHED_PATH_CHARS and path.count("/") <= CACHED_PATH_TOKENS
        return parse_path(path) if cached else parse_path.__wrapped__(path)
    except ValueError as exc:
        raise _Fail(str(exc)) from None


def _value(op: dict):
    if "value" not in op:
        raise _Fail("missing 'value'")
    return op["value"]


def _apply_one(doc, op, growth: _Growth):
    if not isinstance(op, dict):
        raise _Fail(f"an op must be an object, got {_kind(op)}")
    name = op.get("op")
    if not isinstance(name, str) or name not in _OPS:
        raise _Fail(f"unknown op: {_named(name)}" if "op" in op else "missing 'op'")
    path = _tokens(op, "path")
    if name == "add":
        value = _value(op)
        _within_depth(path, value)
        return _add(doc, path, value, growth)
    if name == "remove":
        return _remove(doc, path, growth)
    if name == "replace":
        value = _value(op)
        _within_depth(path, value)
        return value if not path else _edit(doc, path, 0, _leaf_existing, value, False, growth)
    if name == "test":
        value = _value(op)
        if not json_equal(_get(doc, path), value):
            raise _Fail(f"test failed: value is not {shown(json.dumps(value, ensure_ascii=False))}")
        return doc
    src = _tokens(op, "from")
    value = _get(doc, src)
    growth.moved_within_depth(path, src, value)
    if name == "copy":
        growth.disown(value)  # it may hold the target's spine too (a copy of "" into the document)
        doc = _add(doc, path, value, growth)
        growth.copied(doc, path, value)
        return doc
    # move
    if path == src:
        return doc
    if path[: len(src)] == src:
        raise _Fail("cannot move a location into one of its children")
    return _add(_remove(doc, src, growth), path, value, growth)


_OPS = frozenset({"add", "remove", "replace", "move", "copy", "test"})


def apply_ops(doc, ops: list[dict]):
    """Apply RFC 6902 ops to any JSON value and return the new value; raises PatchError.

    `doc` is never mutated; the result shares untouched subtrees with it.
    """
    return _apply_ops(doc, ops, _Growth(None))


def _apply_ops(doc, ops: list[dict], growth: _Growth):
    if not isinstance(ops, list):
        raise PatchError(-1, ops, f"a patch must be an array of ops, got {_kind(ops)}")
    for index, op in enumerate(ops):
        try:
            doc = _apply_one(doc, op, growth)
        except _Fail as exc:
            raise PatchError(index, op, str(exc)) from None
    return doc


def growth_bound(ops: list) -> int:
    """At least what the ops of a patch that applied grow its document's JSON text by, its copies'
    values aside (`PatchOutcome.size` counts them): each value added or replaced, and each token of
    an add's, move's or copy's target as a member ``"token":{},`` (a parent it creates, or the member
    itself). It walks the ops, not the document: a document a few bytes under the limit was
    serialized whole at each patch (12 ms at 16 MB)."""
    bound, memo = 0, {}
    for op in ops:
        name = op["op"]
        if name in ("add", "replace"):
            bound += _text_size(op["value"], memo)
        if name in ("add", "move", "copy"):
            bound += sum(_str_size(token) + 4 for token in _tokens(op, "path"))
    return bound


# ---------------------------------------------------------------- entities


def is_delete(op) -> bool:
    return isinstance(op, dict) and op.get("op") == "remove" and op.get("path") == ""


def _outcome(status, doc=None, error=None, deleted=False, size=None) -> PatchOutcome:
    return PatchOutcome(status, doc, error, deleted, size)


def apply_patch(doc: dict | None, ops: list, *, document: str = "an entity document",
                size: int | None = None, limited: bool = True) -> PatchOutcome:
    """Apply a patch to an entity (None = does not exist). Never raises for bad ops.

    All-add patches on a missing entity create it; a trailing ``remove ""``
    deletes it; any failure returns STATUS_FAILED with the original doc. `document` names
    what the patch applies to in an error (a schema's client reads of its schema). `size`: at
    least the length of the JSON text the patch applies to (`doc`, or ``{}``'s 2), where the
    caller knows it; the outcome's `size` then bounds the result's. `limited` False: no
    `MAX_SHIFTS` (a replay of updates a release before the limit applied).
    """
    if not isinstance(ops, list):
        return _outcome(STATUS_FAILED, doc, f"a patch must be an array of ops, got {_kind(ops)}")
    if doc is None:
        if not ops or not all(isinstance(op, dict) and op.get("op") == "add" for op in ops):
            return _outcome(STATUS_NOT_FOUND, None, "entity does not exist")
        base = {}
    else:
        base = doc
    body, deleted = ops, False
    for index, op in enumerate(ops):
        if is_delete(op):
            if index != len(ops) - 1:
                reason = "deleting the entity (remove \"\") must be the last op"
                return _outcome(STATUS_FAILED, doc, str(PatchError(index, op, reason)))
            body, deleted = ops[:-1], True
    growth = _Growth(size, limited)
    try:
        result = _apply_ops(base, body, growth)
    except PatchError as exc:
        return _outcome(STATUS_FAILED, doc, str(exc))
    if deleted:
        return _outcome(STATUS_OK, None, deleted=True)
    if not isinstance(result, dict):
        return _outcome(
            STATUS_FAILED, doc, f"{document} must be an object, got {_kind(result)}"
        )
    return _outcome(STATUS_OK, result, size=growth.size)
