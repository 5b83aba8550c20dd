"""Unit tests for entity_assets.patch (pure stdlib, milliseconds)."""

import copy
import json
import pickle
import random

import pytest

from entity_assets.patch import (
    MAX_DEPTH,
    MAX_DOCUMENT_BYTES,
    MAX_SHIFTS,
    STATUS_FAILED,
    STATUS_NOT_FOUND,
    STATUS_OK,
    PatchError,
    PatchOutcome,
    apply_ops,
    apply_patch,
    parse_path,
)


def ops_error(doc, ops) -> PatchError:
    with pytest.raises(PatchError) as info:
        apply_ops(doc, ops)
    return info.value


# ---------------------------------------------------------------- RFC 6902 Appendix A


def test_a01_add_object_member():
    assert apply_ops({"foo": "bar"}, [{"op": "add", "path": "/baz", "value": "qux"}]) == {
        "baz": "qux",
        "foo": "bar",
    }


def test_a02_add_array_element():
    doc = {"foo": ["bar", "baz"]}
    assert apply_ops(doc, [{"op": "add", "path": "/foo/1", "value": "qux"}]) == {
        "foo": ["bar", "qux", "baz"]
    }


def test_a03_remove_object_member():
    doc = {"baz": "qux", "foo": "bar"}
    assert apply_ops(doc, [{"op": "remove", "path": "/baz"}]) == {"foo": "bar"}


def test_a04_remove_array_element():
    doc = {"foo": ["bar", "qux", "baz"]}
    assert apply_ops(doc, [{"op": "remove", "path": "/foo/1"}]) == {"foo": ["bar", "baz"]}


def test_a05_replace_value():
    doc = {"baz": "qux", "foo": "bar"}
    assert apply_ops(doc, [{"op": "replace", "path": "/baz", "value": "boo"}]) == {
        "baz": "boo",
        "foo": "bar",
    }


def test_a06_move_value():
    doc = {"foo": {"bar": "baz", "waldo": "fred"}, "qux": {"corge": "grault"}}
    ops = [{"op": "move", "from": "/foo/waldo", "path": "/qux/thud"}]
    assert apply_ops(doc, ops) == {
        "foo": {"bar": "baz"},
        "qux": {"corge": "grault", "thud": "fred"},
    }


def test_a07_move_array_element():
    doc = {"foo": ["all", "grass", "cows", "eat"]}
    ops = [{"op": "move", "from": "/foo/1", "path": "/foo/3"}]
    assert apply_ops(doc, ops) == {"foo": ["all", "cows", "eat", "grass"]}


def test_a08_test_success():
    doc = {"baz": "qux", "foo": ["a", 2, "c"]}
    ops = [
        {"op": "test", "path": "/baz", "value": "qux"},
        {"op": "test", "path": "/foo/1", "value": 2},
    ]
    assert apply_ops(doc, ops) == doc


def test_a09_test_error():
    err = ops_error({"baz": "qux"}, [{"op": "test", "path": "/baz", "value": "bar"}])
    assert err.index == 0 and "test failed" in err.reason


def test_a10_add_nested_member_object():
    doc = {"foo": "bar"}
    ops = [{"op": "add", "path": "/child", "value": {"grandchild": {}}}]
    assert apply_ops(doc, ops) == {"foo": "bar", "child": {"grandchild": {}}}


def test_a11_ignore_unrecognized_elements():
    ops = [{"op": "add", "path": "/baz", "value": "qux", "xyz": 123}]
    assert apply_ops({"foo": "bar"}, ops) == {"foo": "bar", "baz": "qux"}


def test_a12_add_to_nonexistent_target_creates_parents_deliberately():
    # RFC 6902 A.12 says this is an error. Our product extension: `add` creates
    # missing parent OBJECTS, so the result is a nested object instead.
    ops = [{"op": "add", "path": "/baz/bat", "value": "qux"}]
    assert apply_ops({"foo": "bar"}, ops) == {"foo": "bar", "baz": {"bat": "qux"}}


def test_a13_invalid_patch_document_duplicate_op_key():
    # Duplicate members are a JSON parsing matter: Python's json keeps the last
    # "op", so this becomes a remove of a missing member, which still fails.
    ops = json.loads('[{"op": "add", "path": "/baz", "value": "qux", "op": "remove"}]')
    err = ops_error({"foo": "bar"}, ops)
    assert err.reason == "path not found: 'baz'"


def test_a14_tilde_escape_ordering():
    doc = {"/": 9, "~1": 10}
    assert apply_ops(doc, [{"op": "test", "path": "/~01", "value": 10}]) == doc


def test_a15_comparing_strings_and_numbers():
    doc = {"/": 9, "~1": 10}
    err = ops_error(doc, [{"op": "test", "path": "/~01", "value": "10"}])
    assert "test failed" in err.reason


def test_a16_add_array_value():
    ops = [{"op": "add", "path": "/foo/-", "value": ["abc", "def"]}]
    assert apply_ops({"foo": ["bar"]}, ops) == {"foo": ["bar", ["abc", "def"]]}


# ---------------------------------------------------------------- seed sample / entity semantics

SEED_OPS = [
    {"op": "add", "path": "firstName", "value": "Sally"},
    {"op": "add", "path": "lastName", "value": "Anderson"},
    {"op": "add", "path": "phone/home", "value": "1-222-555-1234"},
]


def test_seed_creation_sample():
    out = apply_patch(None, SEED_OPS)
    assert out == PatchOutcome(
        status=STATUS_OK,
        doc={"firstName": "Sally", "lastName": "Anderson", "phone": {"home": "1-222-555-1234"}},
        error=None,
        deleted=False,
    )


def test_update_existing_entity():
    out = apply_patch({"a": 1}, [{"op": "replace", "path": "a", "value": 2}])
    assert (out.status, out.doc, out.error, out.deleted) == (
        STATUS_OK, {"a": 2}, None, False,
    )


def test_missing_entity_non_creation_is_not_found():
    ops = [{"op": "add", "path": "a", "value": 1}, {"op": "replace", "path": "a", "value": 2}]
    out = apply_patch(None, ops)
    assert (out.status, out.doc, out.error) == (STATUS_NOT_FOUND, None, "entity does not exist")
    assert apply_patch(None, []).status == STATUS_NOT_FOUND
    assert apply_patch(None, [{"op": "remove", "path": ""}]).status == STATUS_NOT_FOUND
    # a test op is no creation, alone or after adds (the seed: status 2, not 1 or 3)
    assert apply_patch(None, [{"op": "add", "path": "a", "value": 1},
                              {"op": "test", "path": "a", "value": 1}]).status == STATUS_NOT_FOUND
    assert apply_patch(None, [{"op": "test", "path": "a", "value": 1}]).status == STATUS_NOT_FOUND


def test_removing_the_member_named_empty_is_no_delete():
    """RFC 6901: `/` is the member named "", not the document: only `remove ""` deletes the entity."""
    out = apply_patch({"": 1, "b": 2}, [{"op": "remove", "path": "/"}])
    assert (out.status, out.doc, out.deleted) == (STATUS_OK, {"b": 2}, False)


def test_failed_creation_is_failed():
    ops = [{"op": "add", "path": "a", "value": "x"}, {"op": "add", "path": "a/b", "value": 1}]
    out = apply_patch(None, ops)
    assert out.status == STATUS_FAILED and out.doc is None
    assert out.error == "op 1 (add a/b): cannot add 'b' to a string"


def test_deletion():
    doc = {"a": 1}
    out = apply_patch(doc, [{"op": "test", "path": "/a", "value": 1}, {"op": "remove", "path": ""}])
    assert (out.status, out.doc, out.error, out.deleted) == (
        STATUS_OK, None, None, True,
    )
    assert doc == {"a": 1}


def test_deletion_preceding_ops_must_succeed():
    doc = {"a": 1}
    out = apply_patch(doc, [{"op": "test", "path": "/a", "value": 2}, {"op": "remove", "path": ""}])
    assert out.status == STATUS_FAILED and out.doc is doc and not out.deleted


def test_ops_after_deletion_fail():
    doc = {"a": 1}
    ops = [{"op": "remove", "path": ""}, {"op": "add", "path": "/b", "value": 2}]
    out = apply_patch(doc, ops)
    assert out.status == STATUS_FAILED and out.doc is doc and not out.deleted
    assert out.error.startswith('op 0 (remove ""): ') and "last op" in out.error


def test_remove_root_in_apply_ops_is_an_error():
    assert "entity deletion" in ops_error({"a": 1}, [{"op": "remove", "path": ""}]).reason


def test_root_add_and_replace():
    assert apply_ops({"a": 1}, [{"op": "add", "path": "", "value": [1]}]) == [1]
    assert apply_ops({"a": 1}, [{"op": "replace", "path": "", "value": 3}]) == 3
    out = apply_patch({"a": 1}, [{"op": "replace", "path": "", "value": {"b": 2}}])
    assert out.status == STATUS_OK and out.doc == {"b": 2}


@pytest.mark.parametrize("value", [[1], "x", 3, None, True])
def test_entity_must_stay_an_object(value):
    doc = {"a": 1}
    for op in ("add", "replace"):
        out = apply_patch(doc, [{"op": op, "path": "", "value": value}])
        assert out.status == STATUS_FAILED and out.doc is doc
        assert out.error.startswith("an entity document must be an object")


@pytest.mark.parametrize("ops", [None, {"op": "add"}, "[]", 3])
def test_apply_patch_ops_not_a_list(ops):
    out = apply_patch({"a": 1}, ops)
    assert out.status == STATUS_FAILED and "array of ops" in out.error
    with pytest.raises(PatchError):
        apply_ops({"a": 1}, ops)


@pytest.mark.parametrize("op", [None, "add", 3, ["op", "add"]])
def test_apply_patch_op_not_a_dict(op):
    doc = {"a": 1}
    out = apply_patch(doc, [{"op": "add", "path": "b", "value": 1}, op])
    assert out.status == STATUS_FAILED and out.doc is doc
    assert out.error.startswith("op 1 (<") and "an op must be an object" in out.error
    assert apply_patch(None, [op]).status == STATUS_NOT_FOUND


# ---------------------------------------------------------------- op errors


@pytest.mark.parametrize(
    "op, reason",
    [
        ({"op": "frobnicate", "path": "/a"}, "unknown op: 'frobnicate'"),
        ({"op": ["add"], "path": "/a"}, "unknown op: ['add']"),
        ({"path": "/a", "value": 1}, "missing 'op'"),
        ({"op": "add", "value": 1}, "missing 'path'"),
        ({"op": "remove"}, "missing 'path'"),
        ({"op": "add", "path": 3, "value": 1}, "'path' must be a string, got number"),
        ({"op": "add", "path": ["a"], "value": 1}, "'path' must be a string, got array"),
        ({"op": "add", "path": "/b"}, "missing 'value'"),
        ({"op": "replace", "path": "/a"}, "missing 'value'"),
        ({"op": "test", "path": "/a"}, "missing 'value'"),
        ({"op": "move", "path": "/b"}, "missing 'from'"),
        ({"op": "copy", "path": "/b"}, "missing 'from'"),
        ({"op": "copy", "path": "/b", "from": None}, "'from' must be a string, got null"),
        ({"op": "remove", "path": "/zz"}, "path not found: 'zz'"),
        ({"op": "replace", "path": "/zz", "value": 1}, "path not found: 'zz'"),
        ({"op": "test", "path": "/zz", "value": 1}, "path not found: 'zz'"),
        ({"op": "move", "from": "/zz", "path": "/b"}, "path not found: 'zz'"),
        ({"op": "copy", "from": "/zz", "path": "/b"}, "path not found: 'zz'"),
        ({"op": "move", "from": "/o", "path": "/o/x"}, "cannot move a location into one of its children"),
        ({"op": "add", "path": "/a/x", "value": 1}, "cannot add 'x' to a number"),
        ({"op": "add", "path": "/s/x/y", "value": 1}, "cannot resolve 'x' inside a string"),
        ({"op": "add", "path": "/arr/5/x", "value": 1}, "index out of range: '5' (array length 2)"),
        ({"op": "add", "path": "/arr/3", "value": 1}, "index out of range: '3' (array length 2)"),
        ({"op": "remove", "path": "/arr/2"}, "index out of range: '2' (array length 2)"),
        ({"op": "replace", "path": "/arr/2", "value": 1}, "index out of range: '2' (array length 2)"),
        ({"op": "remove", "path": "/arr/-"}, "index '-' (past the end) is only valid as an add target"),
        ({"op": "test", "path": "/arr/-", "value": 1}, "index '-' (past the end) is only valid as an add target"),
        ({"op": "add", "path": "/arr/01", "value": 1}, "invalid array index: '01'"),
        ({"op": "add", "path": "/arr/x", "value": 1}, "invalid array index: 'x'"),
        ({"op": "add", "path": "/arr/-1", "value": 1}, "invalid array index: '-1'"),
        ({"op": "add", "path": "/arr/\u00b2", "value": 1}, "invalid array index: '\u00b2'"),
        ({"op": "add", "path": "/a~2", "value": 1}, "invalid '~' escape in path '/a~2'"),
        # more digits than int() takes (4,300): the op's failure, not a ValueError that failed every run of its slice
        ({"op": "add", "path": "/arr/" + "1" * 4301, "value": 1}, "index out of range: '11111111111111111111'... "
                                                                   "(array length 2)"),
        ({"op": "remove", "path": "/arr/" + "9" * 5000}, "index out of range: '99999999999999999999'... "
                                                           "(array length 2)"),
        ({"op": "add", "path": "/arr/10", "value": 1}, "index out of range: '10' (array length 2)"),
        ({"op": "add", "path": "/a~", "value": 1}, "invalid '~' escape in path '/a~'"),
    ],
)
def test_op_errors(op, reason):
    doc = {"a": 1, "s": "str", "o": {"k": 1}, "arr": [1, 2]}
    snapshot = json.dumps(doc, sort_keys=True)
    err = ops_error(doc, [op])
    assert (err.index, err.op, err.reason) == (0, op, reason)
    out = apply_patch(doc, [op])
    assert out.status == STATUS_FAILED and out.doc is doc and out.error == str(err)
    assert json.dumps(doc, sort_keys=True) == snapshot


def test_error_message_names_index_op_path_and_reason():
    doc = {"a": 1}
    ops = [
        {"op": "test", "path": "/a", "value": 1},
        {"op": "add", "path": "/b", "value": 2},
        {"op": "replace", "path": "/phone/home", "value": "x"},
    ]
    err = ops_error(doc, ops)
    assert str(err) == "op 2 (replace /phone/home): path not found: 'phone'"
    assert (err.index, err.op, err.reason) == (2, ops[2], "path not found: 'phone'")
    move = {"op": "move", "from": "/zz", "path": "/b"}
    assert str(ops_error(doc, [move])) == "op 0 (move /zz -> /b): path not found: 'zz'"


def test_patch_error_pickles():
    err = pickle.loads(pickle.dumps(PatchError(1, {"op": "add"}, "boom")))
    assert (err.index, err.op, err.reason, str(err)) == (1, {"op": "add"}, "boom", "op 1 (add): boom")


# ---------------------------------------------------------------- ops semantics


def test_add_creates_only_missing_object_parents():
    assert apply_ops({}, [{"op": "add", "path": "/a/b/c", "value": 1}]) == {"a": {"b": {"c": 1}}}
    assert apply_ops({"a": {"x": 0}}, [{"op": "add", "path": "a/b", "value": 1}]) == {
        "a": {"x": 0, "b": 1}
    }
    # a missing array element is not created
    err = ops_error({"arr": []}, [{"op": "add", "path": "/arr/0/x", "value": 1}])
    assert err.reason == "index out of range: '0' (array length 0)"
    # through an array element that exists
    assert apply_ops({"arr": [{}]}, [{"op": "add", "path": "/arr/0/x/y", "value": 1}]) == {
        "arr": [{"x": {"y": 1}}]
    }


def test_add_replaces_existing_member_and_appends():
    assert apply_ops({"a": 1}, [{"op": "add", "path": "/a", "value": 2}]) == {"a": 2}
    assert apply_ops([1, 2], [{"op": "add", "path": "/2", "value": 3}]) == [1, 2, 3]
    assert apply_ops([1, 2], [{"op": "add", "path": "/-", "value": 3}]) == [1, 2, 3]
    assert apply_ops([1, 2], [{"op": "add", "path": "/0", "value": 0}]) == [0, 1, 2]


def test_replace_array_element():
    assert apply_ops([1, 2], [{"op": "replace", "path": "/1", "value": 9}]) == [1, 9]


def test_move_and_copy():
    doc = {"a": {"b": 1}, "arr": [1, 2]}
    assert apply_ops(doc, [{"op": "copy", "from": "/a", "path": "/c"}]) == {
        "a": {"b": 1}, "arr": [1, 2], "c": {"b": 1},
    }
    assert apply_ops(doc, [{"op": "copy", "from": "/a/b", "path": "/arr/-"}])["arr"] == [1, 2, 1]
    assert apply_ops(doc, [{"op": "move", "from": "/a/b", "path": "/arr/-"}]) == {
        "a": {}, "arr": [1, 2, 1],
    }
    # moving to itself is a no-op; moving a child over its parent is allowed
    assert apply_ops(doc, [{"op": "move", "from": "/a", "path": "/a"}]) is doc
    assert apply_ops(doc, [{"op": "move", "from": "/a/b", "path": "/a"}]) == {"a": 1, "arr": [1, 2]}
    # the whole document cannot move into itself
    assert "children" in ops_error(doc, [{"op": "move", "from": "", "path": "/x"}]).reason


def test_test_json_equality():
    doc = {"i": 1, "f": 1.0, "t": True, "n": None, "z": 0, "o": {"a": [1, {"b": False}]}}

    def passes(path, value):
        try:
            apply_ops(doc, [{"op": "test", "path": path, "value": value}])
            return True
        except PatchError:
            return False

    assert passes("/i", 1.0) and passes("/f", 1)  # numbers compare numerically
    assert not passes("/i", True) and not passes("/t", 1)  # booleans are not numbers
    assert not passes("/z", False) and not passes("/z", None) and not passes("/n", False)
    assert passes("/t", True) and passes("/n", None)
    assert passes("/o", {"a": [1.0, {"b": False}]})
    assert not passes("/o", {"a": [1, {"b": 0}]})
    assert not passes("/o", {"a": [1]}) and not passes("/o", {"a": [1, {"b": False}], "x": 1})
    assert not passes("/o/a", {"0": 1}) and not passes("/i", "1")
    assert passes("", doc)


# ---------------------------------------------------------------- paths


def test_parse_path_forms():
    assert parse_path("") == ()
    assert parse_path("/") == ("",)  # RFC: "/" is the empty-string key, not the root
    assert parse_path("a/b") == parse_path("/a/b") == ("a", "b")
    assert parse_path("/a/") == ("a", "")
    assert parse_path("/~0") == ("~",)
    assert parse_path("/~1") == ("/",)
    assert parse_path("/~01") == ("~1",)  # ~1 decoded first
    assert parse_path("/a~1b~0c") == ("a/b~c",)
    assert parse_path("/arr/0") == ("arr", "0")
    with pytest.raises(ValueError):
        parse_path("/a~2")
    with pytest.raises(ValueError):
        parse_path("/~~01")


def test_parse_path_is_cached():
    parse_path.cache_clear()
    parse_path("/cached/path")
    parse_path("/cached/path")
    assert parse_path.cache_info().hits == 1


def test_a_long_path_is_applied_but_not_kept_in_the_cache():
    parse_path.cache_clear()
    long = "/" + "x" * 100_000
    assert apply_patch({}, [{"op": "add", "path": long, "value": 1}]).doc == {"x" * 100_000: 1}
    assert apply_patch({}, [{"op": "add", "path": "/short", "value": 1}]).doc == {"short": 1}
    assert parse_path.cache_info().currsize == 1  # the short one only


def test_a_path_of_many_tokens_is_applied_but_not_kept_in_the_cache():
    """Each token is a string of its own: 65,536 failing removes of 124-token paths kept 764 MB."""
    parse_path.cache_clear()
    many = "/" + "/".join(["\u0101"] * 17)
    assert "path not found" in apply_patch({}, [{"op": "remove", "path": many}]).error
    assert apply_patch({}, [{"op": "add", "path": many[:-2], "value": 1}]).status == STATUS_OK
    assert parse_path.cache_info().currsize == 1  # the one of 16 tokens only
    assert parse_path.cache_info().maxsize <= 4096


def test_paths_in_ops():
    doc = {"": 0, "a/b": 1, "m~n": 2, "arr": [10, 20]}
    assert apply_ops(doc, [{"op": "test", "path": "/", "value": 0}]) == doc
    assert apply_ops(doc, [{"op": "replace", "path": "/", "value": 5}])[""] == 5
    assert apply_ops(doc, [{"op": "remove", "path": "/a~1b"}]).keys() == {"", "m~n", "arr"}
    assert apply_ops(doc, [{"op": "replace", "path": "m~0n", "value": 3}])["m~n"] == 3
    assert apply_ops(doc, [{"op": "test", "path": "arr/1", "value": 20}]) == doc
    assert apply_ops(doc, [{"op": "add", "path": "arr/-", "value": 30}])["arr"] == [10, 20, 30]
    # on an object, "-" and "01" are plain member names
    assert apply_ops({}, [{"op": "add", "path": "/-", "value": 1}]) == {"-": 1}
    assert apply_ops({}, [{"op": "add", "path": "/01", "value": 1}]) == {"01": 1}


# ---------------------------------------------------------------- no mutation / sharing


def make_doc():
    return {
        "name": {"first": "Sally", "last": "Anderson"},
        "phone": {"home": "1", "work": "2"},
        "tags": ["a", "b"],
        "addresses": [{"city": "X"}, {"city": "Y"}],
    }


def test_all_or_nothing():
    doc = make_doc()
    snapshot = json.dumps(doc, sort_keys=True)
    ops = [
        {"op": "replace", "path": "/name/first", "value": "Sal"},
        {"op": "add", "path": "/tags/-", "value": "c"},
        {"op": "remove", "path": "/phone/mobile"},
    ]
    out = apply_patch(doc, ops)
    assert out.status == STATUS_FAILED and out.doc is doc
    assert out.error == "op 2 (remove /phone/mobile): path not found: 'mobile'"
    assert json.dumps(doc, sort_keys=True) == snapshot


def test_no_mutation_on_success_for_every_op():
    doc = make_doc()
    snapshot = json.dumps(doc, sort_keys=True)
    ops = [
        {"op": "add", "path": "/name/middle", "value": "J"},
        {"op": "add", "path": "/tags/0", "value": "z"},
        {"op": "remove", "path": "/addresses/0/city"},
        {"op": "replace", "path": "/phone/home", "value": "9"},
        {"op": "move", "from": "/phone/work", "path": "/name/work"},
        {"op": "copy", "from": "/tags", "path": "/addresses/1/tags"},
        {"op": "test", "path": "/tags", "value": ["z", "a", "b"]},
    ]
    out = apply_patch(doc, ops)
    assert out.status == STATUS_OK
    assert out.doc == {
        "name": {"first": "Sally", "last": "Anderson", "middle": "J", "work": "2"},
        "phone": {"home": "9"},
        "tags": ["z", "a", "b"],
        "addresses": [{}, {"city": "Y", "tags": ["z", "a", "b"]}],
    }
    assert json.dumps(doc, sort_keys=True) == snapshot


def test_structural_sharing():
    doc = make_doc()
    new = apply_ops(doc, [{"op": "replace", "path": "/addresses/1/city", "value": "Z"}])
    assert new is not doc and new["addresses"] is not doc["addresses"]
    assert new["addresses"][1] is not doc["addresses"][1]
    # untouched subtrees are the very same objects
    assert new["name"] is doc["name"] and new["phone"] is doc["phone"]
    assert new["tags"] is doc["tags"] and new["addresses"][0] is doc["addresses"][0]
    # values from ops are shared, not copied
    value = {"deep": [1, 2]}
    assert apply_ops(doc, [{"op": "add", "path": "/v", "value": value}])["v"] is value


def test_input_ops_not_mutated():
    ops = json.loads(json.dumps(SEED_OPS))
    apply_patch(None, ops)
    assert ops == SEED_OPS


def _nested(levels: int):
    value = 1
    for _ in range(levels):
        value = {"x": value}
    return value


@pytest.mark.parametrize("ops", [
    [{"op": "add", "path": "/".join(["a"] * 5000), "value": 1}],  # deeper than Python's recursion limit
    [{"op": "add", "path": "/".join(["a"] * MAX_DEPTH), "value": {}}],
    [{"op": "add", "path": "v", "value": _nested(MAX_DEPTH)}],
    [{"op": "replace", "path": "", "value": {"v": _nested(MAX_DEPTH)}}],
    [{"op": "add", "path": "v", "value": _nested(MAX_DEPTH - 1)}, {"op": "copy", "from": "v", "path": "w/x"}],
    [{"op": "add", "path": "v", "value": _nested(MAX_DEPTH - 1)}, {"op": "move", "from": "v", "path": "w/x"}],
])
def test_too_deep_a_document_fails_the_patch(ops):
    doc = {"w": {}}
    out = apply_patch(doc, ops)
    assert out.status == STATUS_FAILED and out.doc is doc
    assert f"deeper than {MAX_DEPTH} levels" in out.error
    assert len(out.error) < 300  # a 10,000-character path is cut in the error


def test_documents_up_to_the_depth_limit_apply():
    out = apply_patch(None, [{"op": "add", "path": "/".join(["a"] * MAX_DEPTH), "value": 1}])
    assert out.status == STATUS_OK
    out = apply_patch({}, [{"op": "add", "path": "v", "value": _nested(MAX_DEPTH - 2)},
                           {"op": "copy", "from": "v", "path": "w"}])
    assert out.status == STATUS_OK
    assert json.loads(json.dumps(out.doc)) == out.doc


@pytest.mark.parametrize("op", [
    {"op": "test", "path": "/a", "value": "v" * 900_000},
    {"op": "replace", "path": "/" + "k" * 900_000, "value": 1},
    {"op": "add", "path": "/" + "k" * 900_000 + "~2", "value": 1},
    {"op": "add", "path": "/a/" + "k" * 900_000, "value": 1},
    {"op": "x" * 900_000, "path": "/a"},
])
def test_an_error_cuts_what_the_client_sent(op):
    """The response carries the ops already: an error that copied a 900 KB value or token made
    it twice a producer's message limit, so the client never got it."""
    out = apply_patch({"a": 1}, [op])
    assert out.status == STATUS_FAILED and len(out.error) < 500 and "(9000" in out.error, out.error[:300]


def test_a_failed_test_shows_the_value_as_json():
    out = apply_patch({"a": 1}, [{"op": "test", "path": "/a", "value": [True, None, "x"]}])
    assert out.error.endswith('test failed: value is not [true, null, "x"]')


def test_moves_of_a_large_subtree_walk_it_once_a_patch(monkeypatch):
    """25,000 moves of 300,000 arrays back and forth, in one valid message, walked the subtree at
    each move: hours of one task, at every run of its slice."""
    from entity_assets import patch

    walked = []
    monkeypatch.setattr(patch, "nesting", lambda value, limit: walked.append(limit) or 2)
    big = [[] for _ in range(1000)]
    ops = [{"op": "move", "from": "/a", "path": "/b/a"}, {"op": "move", "from": "/b/a", "path": "/a"}] * 500
    out = apply_patch({"a": big, "b": {}}, ops)
    assert out.status == STATUS_OK and out.doc["a"] is big and walked == [MAX_DEPTH]


def test_a_patch_copies_a_container_it_changes_once_not_at_each_op(monkeypatch):
    """24,900 appends to an array of 490,000, in one message under 1 MB, copied the array at each:
    49 s of one task, at every run of its slice. The ops after the first change the patch's copy."""
    from entity_assets import patch

    copies, own = [], patch._own

    def counted(node, growth):
        new = own(node, growth)
        if new is not node:
            copies.append(len(new))  # its members when copied
        return new

    monkeypatch.setattr(patch, "_own", counted)
    doc = {"a": [0] * 1000, "o": {"k": 1}}
    ops = [{"op": "add", "path": "/a/-", "value": 1}, {"op": "replace", "path": "/a/0", "value": 2},
           {"op": "remove", "path": "/a/1"}, {"op": "add", "path": "/o/j", "value": 3},
           {"op": "copy", "from": "/o/k", "path": "/s"}] * 250
    out = apply_ops(doc, ops)
    assert len(copies) == 3  # the document, its array, its object: once each
    assert out["a"] == [2, *[0] * 749, *[1] * 250] and out["o"] == {"k": 1, "j": 3} and out["s"] == 1
    assert doc == {"a": [0] * 1000, "o": {"k": 1}}
    # a copy of a container stops changing it (and what it holds) in place, not the others
    copies.clear()
    out = apply_ops(doc, [{"op": "add", "path": "/o/j", "value": 3}, {"op": "copy", "from": "/o", "path": "/p"},
                          *[{"op": "add", "path": "/a/-", "value": 1}] * 100, {"op": "add", "path": "/o/i", "value": 4}])
    assert copies == [1, 2, 1000, 2]  # o, the document, a; o again after its copy (once)
    assert out["p"] == {"k": 1, "j": 3} and out["o"] == {"k": 1, "j": 3, "i": 4}


def _apply_copying(doc, ops):
    """RFC 6902 by copying the whole document at each op: the reference for the patch engine."""
    for op in ops:
        doc = apply_ops(copy.deepcopy(doc), [op])
    return doc


def test_changing_the_patch_s_own_copies_in_place_applies_what_copying_at_each_op_applies():
    """Copies and moves share and carry containers between places (a copy of "" into the document
    holds its own spine): random patches give what applying their ops one at a time gives, and
    leave the document and the ops as they were."""
    rng = random.Random(20261207)

    def value(depth=0):
        r = rng.random()
        if depth > 2 or r < 0.4:
            return rng.choice([1, "x", None, True, 2.5])
        if r < 0.7:
            return {rng.choice("abcd"): value(depth + 1) for _ in range(rng.randint(0, 3))}
        return [value(depth + 1) for _ in range(rng.randint(0, 3))]

    def paths(node, prefix=""):
        out = [prefix]
        if isinstance(node, dict):
            for k, v in node.items():
                out += paths(v, f"{prefix}/{k}")
        elif isinstance(node, list):
            out += [p for i, v in enumerate(node) for p in paths(v, f"{prefix}/{i}")] + [f"{prefix}/-"]
        return out

    for _ in range(3000):
        doc = {"a": value(), "b": [value() for _ in range(3)], "c": {"d": value()}}
        ops, now = [], doc
        for _ in range(rng.randint(1, 20)):
            known = paths(now)
            name = rng.choice(["add", "add", "remove", "replace", "move", "copy", "test"])
            op = {"op": name, "path": rng.choice(known + [rng.choice(known) + "/" + rng.choice("abcde")])}
            if name in ("add", "replace", "test"):
                op["value"] = value()
            if name in ("move", "copy"):
                op["from"] = rng.choice(known)
            ops.append(op)
            try:
                now = apply_ops(now, [op])
            except PatchError:
                pass
        before, sent = copy.deepcopy(doc), copy.deepcopy(ops)
        try:
            expected = _apply_copying(doc, ops)
        except PatchError as exc:
            expected = str(exc).split(": ", 1)[1]  # the op's index differs: one at a time, each is op 0
        try:
            got = apply_ops(doc, ops)
        except PatchError as exc:
            got = str(exc).split(": ", 1)[1]
        assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True), ops
        assert doc == before and ops == sent


def test_copies_that_double_a_document_fail_at_the_size_limit_without_writing_it_out():
    """Each copy of the whole document shares it: 40 of them would be a terabyte of text."""
    doc = {"x": "y" * 100}
    out = apply_patch(doc, [{"op": "copy", "from": "", "path": f"/k{i}"} for i in range(40)])
    assert out.status == STATUS_FAILED and out.doc is doc
    assert f"over {MAX_DOCUMENT_BYTES} bytes" in out.error and out.error.startswith("op 17 ")
    # across patches too: each measures the document it starts from
    for i in range(40):
        out = apply_patch(doc, [{"op": "copy", "from": "", "path": f"/k{i}"}])
        if out.status != STATUS_OK:
            break
        doc = out.doc
    assert i == 17 and out.status == STATUS_FAILED and len(json.dumps(doc)) <= MAX_DOCUMENT_BYTES


def test_copies_of_one_subtree_into_many_places_count_each_place():
    doc = {"big": {"s": "x" * 100_000}}
    ops = [{"op": "copy", "from": "/big", "path": f"/c{i}"} for i in range(200)]
    out = apply_patch(doc, ops)
    assert out.status == STATUS_FAILED and out.error.startswith("op 166 ")
    assert apply_patch(doc, ops[:150]).status == STATUS_OK


@pytest.mark.parametrize("doc", [
    {"n": [int("9" * 4000)] * 200},  # 800,000 characters of digits, each number more than 5
    {"s": ["\x00" * 1000] * 200},  # 6 characters of text per control character
    {"f": [-1.2345678901234567e-308] * 40_000},
], ids=["long-integers", "control-characters", "floats"])
def test_the_size_limit_counts_every_character_of_numbers_and_escaped_text(doc):
    """A 1 MB message of such values and copies of the whole document must fail before the
    document's text is made: its 13th copy would be gigabytes."""
    ops = [{"op": "copy", "from": "", "path": f"/c{i}"} for i in range(13)]
    out = apply_patch(doc, ops)
    assert out.status == STATUS_FAILED and f"over {MAX_DOCUMENT_BYTES} bytes" in out.error
    done = int(out.error.split()[1])
    assert len(json.dumps(apply_patch(doc, ops[:done]).doc)) <= MAX_DOCUMENT_BYTES


def test_copies_that_overwrite_or_follow_a_remove_count_what_the_document_holds():
    doc = {"big": "x" * 6_000_000}
    twice = [{"op": "copy", "from": "/big", "path": "/x"}] * 2
    assert apply_patch(doc, twice).status == STATUS_OK
    assert apply_patch(doc, [twice[0], {"op": "remove", "path": "/x"},
                             {"op": "copy", "from": "/big", "path": "/y"}]).status == STATUS_OK
    assert apply_patch(doc, [twice[0], {"op": "copy", "from": "/big", "path": "/y"}]).status == STATUS_FAILED


def test_the_depth_check_walks_a_shared_subtree_once():
    """A document of copies of copies is a chain of shared nodes; walking it as a tree never ends."""
    doc = {"a": {"v": 1}}
    for i in range(60):
        doc = apply_patch(doc, [{"op": "copy", "from": "/a", "path": "/a/l"},
                                {"op": "copy", "from": "/a", "path": "/a/r"}]).doc
        if i < 10:
            assert doc["a"]["l"] is doc["a"]["r"]["l"]  # shared, not copied
    out = apply_patch(doc, [{"op": "copy", "from": "/a", "path": "/b"}, {"op": "copy", "from": "/a", "path": "/c"}])
    assert out.status == STATUS_FAILED


def test_a_copy_into_a_document_of_known_size_adds_what_it_copied_to_that_size():
    """Measured at each copy, a 1 MB batch of one-op copies of a scalar into a 1 MB document took 5
    minutes; given the input's size, the bound grows by the value and its member."""
    doc = {"s": "v", "k": list(range(100_000))}
    out = apply_patch(doc, [{"op": "copy", "from": "/s", "path": "/t"}], size=1_000_000)
    assert out.status == STATUS_OK and out.doc == {**doc, "t": "v"}
    assert out.size == 1_000_000 + len('"t":"v",')
    # a bound past the limit is measured: the document fits
    out = apply_patch(doc, [{"op": "copy", "from": "/s", "path": "/t"}], size=MAX_DOCUMENT_BYTES)
    assert out.status == STATUS_OK and len(json.dumps(out.doc, separators=(",", ":"))) <= out.size < 1_000_000


def test_the_size_of_an_array_of_zeros_is_its_text():
    """0 is one character: counted as 2 and a comma, twelve arrays of 490,000 zeros (11.8 MB) failed a
    copy of a scalar as over 16 MiB, which an add of it did not."""
    zeros = [0] * 490_000
    doc = {**{f"k{i}": zeros for i in range(12)}, "s": 1}
    out = apply_patch(doc, [{"op": "copy", "from": "/s", "path": "/t"}])
    assert out.status == STATUS_OK, out.error
    for n in (0, 9, 10, -1, -9, -10, 2**63 - 1, -(2**63), 10**40, 10**40 - 1, -(10**40)):
        out = apply_patch({"n": n}, [{"op": "copy", "from": "", "path": "/c"}])
        assert out.size >= len(json.dumps(out.doc, separators=(",", ":")))  # a bound still


def test_inserts_and_removes_before_an_array_s_end_stop_at_a_budget_of_moved_elements():
    """Each shifts the rest of its array: 26,666 inserts at the front of 490,000 elements took 4 s."""
    doc = {"a": [0] * 990_000}  # 50 inserts at the front move 49,501,225 elements, the 51st 990,050 more
    front = [{"op": "add", "path": "/a/0", "value": 1}]
    assert apply_patch(doc, front * 50).status == STATUS_OK
    out = apply_patch(doc, front * 51)
    assert out.status == STATUS_FAILED and out.doc is doc
    assert out.error == f"op 50 (add /a/0): the patch's inserts and removes would move over {MAX_SHIFTS} array elements"
    out = apply_patch(doc, [{"op": "remove", "path": "/a/1"}] * 51)
    assert out.status == STATUS_FAILED and out.error.startswith("op 50 (remove /a/1): ")
    out = apply_patch(doc, [{"op": "move", "from": "/a/0", "path": "/a/-"}] * 51)
    assert out.status == STATUS_FAILED and out.error.startswith("op 50 (move /a/0 -> /a/-): ")
    # at the end, and replacing, move nothing
    ends = [{"op": "add", "path": "/a/-", "value": 1}, {"op": "remove", "path": "/a/990000"},
            {"op": "replace", "path": "/a/0", "value": 2}] * 1000
    assert apply_patch(doc, ends).status == STATUS_OK
