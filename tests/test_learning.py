"""Unit tests for entity_assets.learning (pure stdlib, milliseconds)."""

import itertools
import json
import pickle
import random
from collections import Counter

import pytest

from entity_assets.learning import (
    TYPES,
    Summary,
    disagreements,
    entity_types,
    infer,
    new_declaration_error,
    normalize_type,
    type_of,
)
from entity_assets.patch import escape_token, parse_path

# The seed's schema-updates sample schema (after homePhone was added) and entity-updates sample entity.
SEED_SCHEMA = {
    "Contacts": {
        "fields": {
            "firstName": {"type": "STRING", "optional": False},
            "lastName": {"type": "STRING", "optional": False},
            "homePhone": {"type": "STRING", "optional": True},
        }
    },
    "Groups": {"fields": {"groupName": {"type": "STRING", "optional": False}}},
}
SALLY = {"firstName": "Sally", "lastName": "Anderson", "phone": {"home": "1-222-555-1234"}}
CONTACTS = SEED_SCHEMA["Contacts"]


def kinds(found):
    return [(d["path"], d["kind"]) for d in found]


@pytest.mark.parametrize("schema, error", [
    (SEED_SCHEMA, None),
    ({**SEED_SCHEMA, "version": 3, "Notes": {}}, None),  # entries that are no entity type, and one without fields
    ({"Contacts": {"fields": {"a": {"type": "DOCUMENT", "fields": {"b": {"type": "INTEGER"}}}}}}, None),
    ({"Contacts": {"fields": {"a": {"type": None, "optional": None}}}}, None),  # null: as if absent
    ({"Contacts": {"fields": {"a": {"type": "STRING", "optional": "false"}}}},
     "Contacts/fields/a/optional: must be true or false"),
    ({"Contacts": {"fields": {"a": {"type": 5}}}}, "Contacts/fields/a/type: must be a type name"),
    ({"Contacts": {"fields": {"a": "STRING"}}}, "Contacts/fields/a: a field spec must be an object"),
    ({"Con/tacts": {"fields": ["a"]}}, "Con~1tacts/fields: must be an object of field specs"),
    ({"C": {"fields": {"a": {"type": "DOCUMENT", "fields": {"b": {"optional": 1}}}}}},
     "C/fields/a/fields/b/optional: must be true or false"),
    (["Contacts"], "a database schema must be an object of entity types"),
])
def test_a_declaration_is_in_the_seeds_style_or_says_where_not(schema, error):
    found = new_declaration_error(None, schema)  # the first of the schema's errors: each here has one at most
    assert found is None if error is None else found.startswith(error), found


# ---------------------------------------------------------------- type_of / names


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, "BOOLEAN"), (False, "BOOLEAN"), (0, "INTEGER"), (1.5, "DOUBLE"),
        ("x", "STRING"), ({}, "DOCUMENT"), ([], "ARRAY"), (None, "NULL"),
        # a whole number, sent as a float or not (JSON has one number type), within a 64-bit integer's range
        (5.0, "INTEGER"), (-0.0, "INTEGER"), (-(2.0**63), "INTEGER"), (2.0**63, "DOUBLE"), (1e300, "DOUBLE"),
        (2**63 - 1, "INTEGER"), (-(2**63), "INTEGER"), (2**63, "DOUBLE"), (2**70, "DOUBLE"),
    ],
)
def test_type_of(value, expected):
    assert type_of(value) == expected
    assert expected in TYPES


def test_type_of_rejects_non_json():
    with pytest.raises(TypeError):
        type_of(object())


@pytest.mark.parametrize(
    "name, expected",
    [
        ("string", "STRING"), ("Long", "INTEGER"), ("int", "INTEGER"), ("FLOAT", "DOUBLE"),
        ("number", "DOUBLE"), ("bool", "BOOLEAN"), ("object", "DOCUMENT"), ("Map", "DOCUMENT"),
        ("list", "ARRAY"), (" double ", "DOUBLE"), ("uuid", "UUID"), (None, None), ("", None),
    ],
)
def test_normalize_type(name, expected):
    assert normalize_type(name) == expected


# ---------------------------------------------------------------- the seed's sample


def test_seed_sample_learned_type():
    learned = infer(Summary.of([SALLY]), CONTACTS)
    assert learned == {
        "fields": {
            "firstName": {"type": "STRING", "optional": False},
            "homePhone": {"type": "STRING", "optional": True},
            "lastName": {"type": "STRING", "optional": False},
            "phone": {"type": "DOCUMENT", "optional": False, "fields": {"home": {"type": "STRING", "optional": False}}},
        }
    }
    assert list(learned["fields"]) == sorted(learned["fields"])


def test_seed_sample_disagreements():
    found = disagreements(Summary.of([SALLY]), CONTACTS)
    # phone only (not phone/home); homePhone is optional so its absence is fine
    assert kinds(found) == [("phone", "undeclared")]
    assert "1 of 1" in found[0]["detail"]


def test_entity_types_of_seed_schema():
    types = entity_types({**SEED_SCHEMA, "comment": "not a collection", "n": 3})
    assert set(types) == {"Contacts", "Groups"}
    assert types["Contacts"] is CONTACTS
    assert entity_types(None) == {}
    assert entity_types([]) == {}


def test_declared_none_makes_every_top_level_field_undeclared():
    found = disagreements(Summary.of([SALLY]), None)
    assert kinds(found) == [("firstName", "undeclared"), ("lastName", "undeclared"), ("phone", "undeclared")]
    assert infer(Summary.of([SALLY])) == infer(Summary.of([SALLY]), None)


# ---------------------------------------------------------------- optional inference


def test_field_in_two_of_three_documents_is_optional():
    s = Summary.of([{"a": 1, "b": "x"}, {"a": 2}, {"a": 3, "b": "y"}])
    assert infer(s)["fields"] == {
        "a": {"type": "INTEGER", "optional": False},
        "b": {"type": "STRING", "optional": True},
    }


def test_nested_optional_is_relative_to_parent_documents():
    docs = [
        {"phone": {"home": "1", "work": "2"}},
        {"phone": {"home": "3"}},
        {},  # lacks phone: phone optional, says nothing about phone/home
    ]
    fields = infer(Summary.of(docs))["fields"]
    assert fields["phone"]["optional"] is True
    assert fields["phone"]["fields"] == {
        "home": {"type": "STRING", "optional": False},
        "work": {"type": "STRING", "optional": True},
    }


def test_deeply_nested_documents():
    s = Summary.of([{"a": {"b": {"c": {"d": True}}}}, {"a": {"b": {"c": {}}}}])
    d = infer(s)["fields"]["a"]["fields"]["b"]["fields"]["c"]["fields"]["d"]
    assert d == {"type": "BOOLEAN", "optional": True}


def test_declared_required_field_missing_becomes_optional_in_learned_only():
    s = Summary.of([{"firstName": "A", "lastName": "B"}, {"firstName": "C"}])
    learned = infer(s, CONTACTS)["fields"]
    assert learned["lastName"] == {"type": "STRING", "optional": True}
    assert CONTACTS["fields"]["lastName"]["optional"] is False  # declared untouched


def test_a_declared_required_field_no_observed_document_has_is_learned_optional():
    learned = infer(Summary.of([{"a": 1}]), {"fields": {"b": {"type": "STRING", "optional": False}}})["fields"]
    assert learned["b"] == {"type": "STRING", "optional": True}


def test_a_field_declared_null_takes_its_observed_type():
    learned = infer(Summary.of([{"x": 1}]), {"fields": {"x": {"type": "NULL", "optional": True}}})["fields"]
    assert learned["x"] == {"type": "INTEGER", "optional": True}


def test_disagreements_are_found_at_any_depth_of_declared_documents():
    declared = {"fields": {"address": {"type": "DOCUMENT", "optional": False, "fields": {"geo": {
        "type": "DOCUMENT", "optional": False, "fields": {"lat": {"type": "DOUBLE", "optional": False}}}}}}}
    found = disagreements(Summary.of([{"address": {"geo": {"lon": 2.0}}}]), declared)
    assert kinds(found) == [("address/geo/lat", "required_missing"), ("address/geo/lon", "undeclared")]


def test_declared_fields_kept_when_nothing_observed():
    assert infer(Summary(), CONTACTS) == {
        "fields": {
            "firstName": {"type": "STRING", "optional": False},
            "homePhone": {"type": "STRING", "optional": True},
            "lastName": {"type": "STRING", "optional": False},
        }
    }
    assert disagreements(Summary(), CONTACTS) == []


# ---------------------------------------------------------------- types


def test_integer_and_double_widen_to_double():
    s = Summary.of([{"n": 1}, {"n": 2}, {"n": 2.5}])
    assert infer(s)["fields"]["n"] == {"type": "DOUBLE", "optional": False}
    assert disagreements(s, {"fields": {"n": {"type": "double", "optional": False}}}) == []


def test_declared_integer_widened_by_double_but_reported():
    declared = {"fields": {"n": {"type": "LONG", "optional": False}}}
    s = Summary.of([{"n": 1}, {"n": 2.5}])
    assert infer(s, declared)["fields"]["n"] == {"type": "DOUBLE", "optional": False}
    assert kinds(disagreements(s, declared)) == [("n", "type_conflict")]


def test_string_integer_conflict_most_frequent_wins_and_is_reported():
    s = Summary.of([{"x": "a"}, {"x": 1}, {"x": 2}])
    assert infer(s)["fields"]["x"]["type"] == "INTEGER"
    found = disagreements(s, None)
    assert kinds(found) == [("x", "undeclared")]
    assert "conflicting" in found[0]["detail"]

    declared = {"fields": {"x": {"type": "STRING", "optional": False}}}
    found = disagreements(s, declared)
    assert kinds(found) == [("x", "type_conflict")]
    assert "INTEGER×2" in found[0]["detail"] and "STRING" in found[0]["detail"]
    # the declaration is authoritative: a contradiction is reported, not learned
    assert infer(s, declared)["fields"]["x"]["type"] == "STRING"


def test_conflict_tie_broken_by_types_order():
    s = Summary.of([{"x": True}, {"x": "a"}])
    assert infer(s)["fields"]["x"]["type"] == "STRING"  # STRING precedes BOOLEAN in TYPES
    s = Summary.of([{"x": [1]}, {"x": {"a": 1}}])
    fields = infer(s)["fields"]
    assert fields["x"]["type"] == "DOCUMENT"
    assert fields["x"]["fields"] == {"a": {"type": "INTEGER", "optional": False}}


def test_numbers_count_together_against_other_types():
    s = Summary.of([{"x": 1}, {"x": 2.5}, {"x": "a"}])
    assert infer(s)["fields"]["x"]["type"] == "DOUBLE"


def test_null_handling():
    s = Summary.of([{"x": None}, {"x": "a"}, {"y": None}])
    fields = infer(s)["fields"]
    assert fields["x"] == {"type": "STRING", "optional": True}  # NULL with T -> T, optional
    assert fields["y"] == {"type": "NULL", "optional": True}  # only ever NULL

    optional = {"fields": {"x": {"type": "STRING", "optional": True}, "y": {"type": "STRING", "optional": True}}}
    assert disagreements(s, optional) == []
    required = {"fields": {"x": {"type": "STRING", "optional": False}}}
    found = disagreements(s, required)
    assert kinds(found) == [("x", "required_missing"), ("x", "type_conflict"), ("y", "undeclared")]
    assert "NULL×1" in found[1]["detail"]
    assert infer(s, required)["fields"]["x"] == {"type": "STRING", "optional": True}


def test_declared_synonyms_any_case():
    declared = {"fields": {"n": {"type": "number", "optional": False}, "m": {"type": "Map", "optional": True}}}
    s = Summary.of([{"n": 3, "m": {"k": "v"}}])
    assert disagreements(s, declared) == []
    assert infer(s, declared)["fields"] == {
        "m": {"type": "DOCUMENT", "optional": True, "fields": {"k": {"type": "STRING", "optional": False}}},
        "n": {"type": "DOUBLE", "optional": False},
    }


# ---------------------------------------------------------------- disagreements


def test_required_missing_with_counts():
    s = Summary.of([{"firstName": "A", "lastName": "B"}, {"firstName": "C"}, {"homePhone": "1"}])
    found = disagreements(s, CONTACTS)
    assert kinds(found) == [("firstName", "required_missing"), ("lastName", "required_missing")]
    assert found[0]["detail"] == "missing in 1 of 3 documents"
    assert found[1]["detail"] == "missing in 2 of 3 documents"


def test_nested_declared_document():
    declared = {
        "fields": {
            "address": {
                "type": "DOCUMENT",
                "optional": True,
                "fields": {"street": {"type": "STRING", "optional": False}},
            }
        }
    }
    s = Summary.of([
        {"address": {"street": "Main", "geo": {"lat": 51.5}}},
        {"address": {"zip/code": 12345}},
        {},
    ])
    found = disagreements(s, declared)
    assert kinds(found) == [
        ("address/geo", "undeclared"),  # top-most only: no address/geo/lat
        ("address/street", "required_missing"),
        ("address/zip~1code", "undeclared"),  # RFC 6901 escaped
    ]
    assert found[1]["detail"] == "missing in 1 of 2 documents"  # of the 2 address documents
    assert parse_path(found[2]["path"]) == ("address", "zip/code")
    learned = infer(s, declared)["fields"]["address"]
    assert learned["optional"] is True
    assert learned["fields"]["street"] == {"type": "STRING", "optional": True}
    assert learned["fields"]["geo"]["fields"]["lat"] == {"type": "DOUBLE", "optional": False}


def test_a_field_spec_with_nested_fields_and_no_type_is_a_document():
    declared = {"fields": {"a": {"optional": False, "fields": {"b": {"type": "STRING", "optional": False}}}}}
    s = Summary.of([{"a": {"b": 1, "c": 2}}, {"a": {}}])
    assert kinds(disagreements(s, declared)) == [("a/b", "required_missing"), ("a/b", "type_conflict"),
                                                 ("a/c", "undeclared")]
    assert infer(s, declared)["fields"]["a"] == {"type": "DOCUMENT", "optional": False, "fields": {
        "b": {"type": "STRING", "optional": True}, "c": {"type": "INTEGER", "optional": True}}}


def test_a_field_declared_without_a_type_is_typed_by_what_is_learned_and_null_before():
    declared = {"fields": {"a": {"optional": True}}}
    assert infer(Summary(), declared)["fields"]["a"] == {"type": "NULL", "optional": True}
    assert infer(Summary.of([{"a": "x"}]), declared)["fields"]["a"] == {"type": "STRING", "optional": True}


def test_a_declared_type_the_learner_does_not_know_admits_any_value_and_is_kept():
    """A declaration may use richer names (`UUID`, `DATE`): no type conflict the client could fix."""
    declared = {"fields": {"id": {"type": "UUID", "optional": False}, "at": {"type": "date", "optional": True}}}
    s = Summary.of([{"id": "5c1f", "at": 1700000000000}, {"id": "9a2b", "at": "2026-12-07"}])
    assert disagreements(s, declared) == []
    assert infer(s, declared)["fields"] == {"at": {"type": "DATE", "optional": True},
                                            "id": {"type": "UUID", "optional": False}}


def test_a_whole_number_sent_as_a_float_fits_a_declared_integer():
    declared = {"fields": {"n": {"type": "INTEGER", "optional": False}}}
    s = Summary.of([{"n": 5.0}, {"n": 6}])
    assert disagreements(s, declared) == [] and infer(s, declared)["fields"]["n"]["type"] == "INTEGER"


def test_paths_under_a_field_named_empty_read_back_as_that_field():
    """`parse_path` drops a path's leading slash: a path under the empty name keeps it."""
    s = Summary.of([{"": {"b": 1}}])
    assert [parse_path(d["path"]) for d in disagreements(s, {"fields": {}})] == [("",)]
    declared = {"fields": {"": {"type": "DOCUMENT", "optional": False, "fields": {}}}}
    assert [parse_path(d["path"]) for d in disagreements(s, declared)] == [("", "b")]
    error = new_declaration_error(None, {"": {"fields": {"a": {"optional": "no"}}}})
    assert parse_path(error.split(":")[0]) == ("", "fields", "a", "optional")


def test_document_declared_without_fields_is_unconstrained_inside():
    declared = {"fields": {"meta": {"type": "OBJECT", "optional": False}}}
    s = Summary.of([{"meta": {"anything": 1}}])
    assert disagreements(s, declared) == []
    assert infer(s, declared)["fields"]["meta"]["fields"] == {"anything": {"type": "INTEGER", "optional": False}}


# ---------------------------------------------------------------- merging and storage


def random_doc(rng, depth=0):
    doc = {}
    for name in rng.sample(["a", "b", "c", "d"], rng.randint(0, 4)):
        choice = rng.randrange(7 if depth < 3 else 6)
        doc[name] = [None, True, 1, 1.5, "s", [1], None][choice] if choice < 6 else random_doc(rng, depth + 1)
    return doc


def test_merge_of_split_summaries_equals_summary_of_all():
    rng = random.Random(4)
    docs = [random_doc(rng) for _ in range(200)]
    whole = Summary.of(docs)
    parts = [Summary.of(docs[i:i + 37]) for i in range(0, len(docs), 37)]
    # any grouping and any order
    left = Summary()
    for p in parts:
        left.merge(Summary.from_json(p.to_json()))
    right = Summary()
    for p in reversed(parts):
        right = Summary.from_json(p.to_json()).merge(right)
    assert left == whole == right
    assert left.to_json() == whole.to_json()
    assert infer(left, CONTACTS) == infer(whole, CONTACTS)


def test_merge_associative_and_commutative():
    rng = random.Random(7)
    a, b, c = (Summary.of(random_doc(rng) for _ in range(20)) for _ in range(3))

    def copy(s):
        return Summary.from_json(s.to_json())

    ab_c = copy(a).merge(copy(b)).merge(copy(c))
    a_bc = copy(a).merge(copy(b).merge(copy(c)))
    for x, y, z in itertools.permutations((a, b, c)):
        assert copy(x).merge(copy(y)).merge(copy(z)) == ab_c
    assert ab_c == a_bc
    assert ab_c.observed == 60


def test_merge_returns_self_and_never_aliases_other():
    a = Summary.of([{"p": {"q": 1}}])
    b = Summary()
    assert b.merge(a) is b
    b.observe({"p": {"q": "x"}})
    assert a.to_json() == Summary.of([{"p": {"q": 1}}]).to_json()
    assert a.merge(a).observed == 2


def test_json_round_trip():
    s = Summary.of([SALLY, {"firstName": None, "tags": ["x"], "n": 1.5, "ok": False}])
    text = s.to_json()
    back = Summary.from_json(text)
    assert back == s and back.to_json() == text
    assert back.observed == 2
    assert Summary.from_json(Summary().to_json()) == Summary()
    assert pickle.loads(pickle.dumps(s)) == s  # ships to and from Spark tasks


@pytest.mark.parametrize(
    "text",
    ['[]', '{"observed": 1, "fields": {}}', '{"format": 1, "observed": -1, "fields": {}}',
     '{"format": 1, "observed": 1, "fields": {"a": {"present": 1, "types": {"TEXT": 1}}}}'],
)
def test_from_json_rejects_malformed(text):
    with pytest.raises(ValueError):
        Summary.from_json(text)


def test_observe_rejects_non_documents():
    with pytest.raises(TypeError):
        Summary().observe(None)


def test_determinism():
    docs = [SALLY, {"z": 1, "a": {"y": 2, "b": None}}, {"lastName": 3}]
    rev = [dict(reversed(list(d.items()))) for d in reversed(docs)]
    s1, s2 = Summary.of(docs), Summary.of(rev)
    assert s1.to_json() == s2.to_json()
    assert json.loads(s1.to_json()) == json.loads(s2.to_json())
    assert json.dumps(infer(s1, CONTACTS)) == json.dumps(infer(s2, CONTACTS))
    assert disagreements(s1, CONTACTS) == disagreements(s2, CONTACTS)
    d = disagreements(s1, CONTACTS)
    assert d == sorted(d, key=lambda x: (x["path"], x["kind"]))


def test_the_check_shows_a_bounded_report_and_counts_it_all():
    """A document used as a map makes a disagreement per key: the event log keeps every slice's metadata."""
    from entity_assets.assets.schemas import SHOWN, _declared_schema_check

    report = {f"db/{escape_token('a/b')}{i}": [{"path": f"k{j}", "kind": "undeclared"} for j in range(SHOWN + 5)]
              for i in range(SHOWN + 3)}
    check = _declared_schema_check(report)
    shown = check.metadata["disagreements"].value
    assert len(shown) == SHOWN and {len(issues) for issues in shown.values()} == {SHOWN}
    assert check.metadata["collections_disagreeing"].value == SHOWN + 3
    assert check.metadata["disagreement_count"].value == (SHOWN + 3) * (SHOWN + 5)
    assert "db/a~1b0" in shown  # the collection "a/b0" of database "db", not collection "b0" of "db/a"


def _merged_in_any_order(docs: list[dict], rng, size: int):
    """Summaries of `docs` shuffled, cut in parts of `size`, each through its JSON, merged in a random order."""
    for _ in range(5):
        shuffled = docs[:]
        rng.shuffle(shuffled)
        parts = [Summary.of(shuffled[i:i + size]) for i in range(0, len(shuffled), size)]
        merged = Summary()
        for part in rng.sample(parts, len(parts)):
            merged.merge(Summary.from_json(part.to_json()))
        yield merged


def test_a_document_used_as_a_map_keeps_the_smallest_names_in_any_merge_order(monkeypatch):
    """A client's document with a key per id (80,000 of them in 960 KB) made a summary, and a
    learned type, of every key, which every learning slice read and rewrote. The names kept are
    the same, with exact counts, however the partials were split and merged."""
    import random

    from entity_assets import learning

    monkeypatch.setattr(learning, "MAX_FIELDS", 10)
    docs = [{"id": i, "map": {f"k{j:03d}": j for j in range(i, i + 30)}} for i in range(40)]
    whole = Summary.of(docs)
    for merged in _merged_in_any_order(docs, random.Random(3), 7):
        assert merged == whole
    shown, cut = whole.fields["map"].doc.shown()
    assert sorted(shown) == [f"k{j:03d}" for j in range(10)] and cut
    assert shown["k005"].present == 6  # docs 0-5 have it: exact
    learned = infer(whole)
    assert learned["fields"]["map"]["fieldsTruncated"] is True and "fieldsTruncated" not in learned
    assert Summary.from_json(whole.to_json()) == whole


def test_a_summary_at_hand_learns_the_type_its_stored_copy_and_any_merge_of_it_learn(monkeypatch):
    """`observe` trims the level it walks, lazily: `infer` of a summary at hand (`Summary.of`) kept
    nested names past MAX_FIELDS that the stored summary, trimmed at every level, left out, and
    comparing two summaries trimmed them in place. Every level is settled first now."""
    import random

    from entity_assets import learning

    monkeypatch.setattr(learning, "MAX_FIELDS", 3)
    docs = [{"id": i, "perm": {f"u{(i + a) % 5}": {f"r{(i * b) % 5}": "rw" for b in range(3)} for a in range(2)}}
            for i in range(30)]
    learned = infer(Summary.of(docs))
    assert learned == infer(Summary.from_json(Summary.of(docs).to_json()))
    assert sorted(learned["fields"]["perm"]["fields"]) == ["u0", "u1", "u2"]
    whole = Summary.of(docs)
    for merged in _merged_in_any_order(docs, random.Random(5), 7):
        assert infer(merged) == learned and merged == whole and infer(whole) == learned


def _paths(doc: dict, prefix: tuple = ()) -> Counter:
    """Each path of `doc`, once (a level's count of documents having it)."""
    out = Counter()
    for name, value in doc.items():
        out[(*prefix, name)] += 1
        if isinstance(value, dict):
            out += _paths(value, (*prefix, name))
    return out


def _kept(summary: Summary, prefix: tuple = ()) -> dict:
    out = {}
    for name, f in summary.fields.items():
        out[(*prefix, name)] = f.present
        if f.doc is not None:
            out.update(_kept(f.doc, (*prefix, name)))
    return out


def test_a_map_of_maps_keeps_the_first_paths_with_exact_counts_in_any_merge_order(monkeypatch):
    """The bound on a level's names left a map of maps (a key per user, then per item) a million
    paths: a 43 MB summary and a 47 MB learned row, rewritten at each learning slice. A summary
    keeps its first paths, the shallowest, then by name, each with the counts of every document
    however the partials were split and merged; the levels that left names out say so."""
    import random

    from entity_assets import learning

    monkeypatch.setattr(learning, "MAX_PATHS", 40)
    monkeypatch.setattr(learning, "MAX_FIELDS", 6)
    rng = random.Random(11)
    docs = [{"id": i, "users": {f"u{rng.randrange(12):02d}": {f"i{rng.randrange(30):02d}": {"n": 1} for _ in range(4)}
                                for _ in range(3)}} for i in range(40)]
    whole = Summary.of(docs)
    for merged in _merged_in_any_order(docs, random.Random(3), 7):
        assert merged == whole and infer(merged) == infer(whole)
    everything = sum((_paths(d) for d in docs), Counter())
    first = sorted(everything, key=lambda path: (len(path), path))[:40]
    assert _kept(Summary.from_json(whole.to_json())) == {path: everything[path] for path in first}  # exact
    users = whole.fields["users"].doc
    assert not whole.truncated and len(users.fields) == 12 and users.shown()[1]  # 12 names kept, 6 shown
    assert users.fields["u11"].doc.truncated and not users.fields["u11"].doc.fields  # past the bound
    learned = infer(whole)["fields"]["users"]
    assert learned["fieldsTruncated"] and sorted(learned["fields"]) == [f"u{j:02d}" for j in range(6)]
    assert Summary.from_json(whole.to_json()) == whole


def test_a_summary_keeps_ten_thousand_paths():
    """Two documents of 1,000 names of 125 each: 251,000 paths, a summary of a few kept."""
    docs = [{f"{i:03}": {f"{k}{j:03}": 0 for j in range(125)} for i in range(1000)} for k in range(2)]
    summary = Summary.from_json(Summary.of(docs).to_json())
    kept = _kept(summary)
    assert len(kept) == 10_000 and all(n == 2 for path, n in kept.items() if len(path) == 1)
    assert len(summary.to_json()) < 1_000_000 and len(json.dumps(infer(summary))) < 1_000_000


def test_a_field_declared_null_is_no_constraint_as_a_field_declared_without_a_type():
    """`infer` learns a NULL-declared field's type as for one declared without a type: the check
    reported every value of it as a type conflict, at every slice."""
    summary = Summary.of([{"x": "a"}, {"x": None}])
    for spec in ({"type": "NULL", "optional": True}, {"optional": True}):
        declared = {"fields": {"x": spec}}
        assert infer(summary, declared)["fields"]["x"] == {"type": "STRING", "optional": True}
        assert disagreements(summary, declared) == []


def test_the_check_shows_client_names_and_paths_cut():
    """50 learning messages with a 900 KB field name each made a 47 MB check event, which the
    event log keeps and the UI loads."""
    from entity_assets.assets.schemas import _declared_schema_check

    report = {f"db/{'c' * 5000}": [{"path": f"/{'f' * 900_000}", "kind": "undeclared", "detail": "observed"}]}
    result = _declared_schema_check(report)
    shown = json.dumps(result.metadata["disagreements"].value)
    assert len(shown) < 1_000 and "(900001 chars)" in shown and "(5003 chars)" in shown


def test_a_declared_field_past_the_names_kept_is_neither_missing_nor_made_optional(monkeypatch):
    """A level past MAX_FIELDS says nothing of the names it left out: `status`, in every document
    and sorted after the kept names, was learned optional and reported missing from all."""
    from entity_assets import learning

    monkeypatch.setattr(learning, "MAX_FIELDS", 10)
    docs = [{"status": "ok", **{f"attr_{(i * 5 + j) % 40:04d}": j for j in range(5)}} for i in range(30)]
    declared = {"fields": {"status": {"type": "STRING"}, "attr_0000": {"type": "INTEGER"}}}
    summary = Summary.of(docs)
    shown, cut = summary.shown()
    assert "status" not in shown and cut
    assert infer(summary, declared)["fields"]["status"] == {"type": "STRING", "optional": False}
    assert not [d for d in disagreements(summary, declared) if d["path"] == "status"]
    assert infer(summary, declared)["fields"]["attr_0000"]["optional"] is True  # kept: counted, in some documents


def test_two_collections_alike_once_cut_stay_two_entries_of_the_check():
    from entity_assets.assets.schemas import _declared_schema_check

    issue = {"path": "x", "kind": "undeclared", "detail": "observed"}
    report = {f"db/{'c' * 200}{end}": [issue] for end in "ab"}
    metadata = _declared_schema_check(report).metadata
    assert metadata["collections_disagreeing"].value == 2 and len(metadata["disagreements"].data) == 2


def test_kafka_connect_s_type_names_are_the_types_they_name():
    declared = {"fields": {"q": {"type": "INT32", "optional": False}, "r": {"type": "FLOAT64", "optional": False},
                           "p": {"type": "STRUCT", "optional": False,
                                 "fields": {"home": {"type": "STRING", "optional": False}}}}}
    s = Summary.of([{"q": "x", "r": "y", "p": {"home": 1}}])
    assert {(d["path"], d["kind"]) for d in disagreements(s, declared)} == {
        ("q", "type_conflict"), ("r", "type_conflict"), ("p/home", "type_conflict")}
    assert infer(Summary.of([{"q": 1, "r": 1.5, "p": {"home": "x"}}]), declared)["fields"] == {
        "p": {"type": "DOCUMENT", "optional": False, "fields": {"home": {"type": "STRING", "optional": False}}},
        "q": {"type": "INTEGER", "optional": False}, "r": {"type": "DOUBLE", "optional": False}}


def test_a_type_learning_does_not_know_keeps_the_fields_declared_inside_it():
    declared = {"fields": {"at": {"type": "GEOPOINT", "optional": False,
                                  "fields": {"lat": {"type": "DOUBLE", "optional": False}}}}}
    expected = {"type": "GEOPOINT", "optional": False, "fields": {"lat": {"type": "DOUBLE", "optional": False}}}
    assert infer(Summary.of([]), declared)["fields"]["at"] == expected
    assert infer(Summary.of([{"at": {"lat": 1.5}}]), declared)["fields"]["at"] == expected


def test_a_declaration_error_cuts_the_names_the_client_sent():
    """The error rides in three streams' messages: a 200,000-character name made one that size."""
    name = "f" * 200_000
    error = new_declaration_error(None, {"Contacts": {"fields": {name: {"type": "STRING", "optional": "yes"}}}})
    assert len(error) < 300 and error.endswith(": must be true or false"), error[:200]


def test_a_removed_type_excuses_only_the_errors_of_the_same_type_moved_unchanged():
    """An unrelated type added beside a removal was excused by any removed type's error of the same text."""
    held = {"fields": {"x": {"type": "STRING", "optional": "yes"}}}
    before = {"Old": held}
    assert new_declaration_error(before, {"New": held}) is None  # a move: the same type under another name
    other = {"fields": {"x": {"type": "INTEGER", "optional": "yes"}}}
    assert new_declaration_error(before, {"Brand": other}) == "Brand/fields/x/optional: must be true or false"
