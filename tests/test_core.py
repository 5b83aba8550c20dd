"""The entity core's pure functions against the seed's own samples (no Spark, no Kafka)."""

import json

import pytest

from entity_assets import core
from entity_assets.messages import CompleteResponse, EntityPatch, EntityUpdate, PartialResponse, parse_message
from entity_assets.publish import STREAMS, murmur2, partition_for, partitions_for
from entity_assets.samples import SEED_ENTITY_BATCH
from entity_assets.tables import SCHEMAS

SALLY = "400cb092-00af-4e44-bdcb-1a0c536692bf"
WILLIAM = "101c3c90-e304-4279-b6a0-020363c925c6"
LINEAGE = {"slice": "0000000001", "kafka_topic": "entity-batches", "kafka_partition": 0, "kafka_offset": 7,
           "kafka_timestamp": 1415747086327}


def batch_row(batch: dict) -> dict:
    return {**LINEAGE, "clientid": batch["clientid"], "request": batch["request"], "user": batch["user"],
            "dbid": batch["db"], "begun": batch["begun"], "patches": json.dumps(batch["patches"]),
            "learning": batch["learning"], "includeBefore": batch["includeBefore"],
            "includeAfter": batch["includeAfter"]}


def explode_batch(batch: dict) -> list[dict]:
    """The entity_patches rows of a batch row, as `fold.explode_task` makes them in Arrow."""
    head = {name: batch[name] for name in core.PATCH_FROM_BATCH}
    return [{**head, **dict(zip(core.PATCH_FIELDS, patch))} for patch in core.explode(batch["dbid"], batch["patches"])]


def test_explode_yields_the_seed_entity_patch_sample():
    (patch,) = explode_batch(batch_row(SEED_ENTITY_BATCH))
    expected = {
        "db": "my-db", "collection": "Contacts", "zone": "default", "entity": SALLY,
        "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd", "request": 2, "user": "jsmith", "begun": 1415747086227,
        "part": 1, "parts": 1, "includeBefore": True, "includeAfter": True, "learning": True,
        "ops": SEED_ENTITY_BATCH["patches"][0]["ops"],
    }
    message = json.loads(core.patch_json(patch))
    assert {k: v for k, v in message.items() if k != "dbid"} == expected
    assert patch["bucket"] == core.bucket_of("my-db", "Contacts", "default", SALLY)
    parse_message(EntityPatch, json.dumps(message).encode())


def test_fold_yields_the_seed_entity_update_sample():
    (patch,) = explode_batch(batch_row(SEED_ENTITY_BATCH))
    state = core.DocState()
    result = core.apply_one(state, patch)
    message = json.loads(core.result_json(result))
    assert message.pop("ended") == LINEAGE["kafka_timestamp"]  # from the record, not the wall clock
    assert message["before"] is None and "before" in message  # created: before is null, not absent
    assert message["after"] == {"firstName": "Sally", "lastName": "Anderson", "phone": {"home": "1-222-555-1234"}}
    assert message["status"] == 1 and result["action"] == "created"
    assert state.version == 1 and state.changed
    parse_message(EntityUpdate, json.dumps({**message, "ended": 1}).encode())


def test_learning_message_is_the_update_with_its_document_whether_asked_for_or_not():
    (patch,) = explode_batch(batch_row(SEED_ENTITY_BATCH))
    state = core.DocState()
    result = core.apply_one(state, patch)

    def learning(result):  # the schema-learning row of an update, as fold.Outputs makes it in Arrow
        return {**result, "after": core.learned_after(result["after"], state.doc), "kind": "entity"}

    assert core.result_json(learning(result)) == core.result_json(result)  # after asked for
    quiet = core.apply_one(core.DocState(), {**patch, "includeAfter": False})
    assert "after" not in json.loads(core.result_json(quiet))
    learned = json.loads(core.result_json(learning(quiet)))
    assert learned["after"] == state.doc and learned["learning"] is True


def test_failed_patch_leaves_state_and_reports_status_3():
    state = core.DocState({"document": json.dumps({"a": 1}), "version": 4, "deleted": False, "ended": 9})
    patch = {**LINEAGE, "clientid": "c", "request": 1, "user": "u", "dbid": "d", "collection": "C", "zone": "z",
             "entity": "e", "parts": 1, "part": 1, "begun": 1, "learning": False, "includeBefore": True,
             "includeAfter": True, "ops": json.dumps([{"op": "replace", "path": "a", "value": 2},
                                                      {"op": "remove", "path": "missing"}])}
    result = core.apply_one(state, patch)
    assert result["status"] == 3 and "op 1 (remove" in result["error"]
    assert state.doc == {"a": 1} and state.version == 4 and not state.changed
    message = json.loads(core.result_json(result))
    assert "before" not in message and "after" not in message and message["error"]


@pytest.mark.parametrize("held", [None, {"Contacts": {"fields": {}}}])
def test_a_schema_patch_that_deletes_the_schema_fails_and_one_that_empties_it_applies(held):
    """Every database has a schema: a tombstone would read as none, and the next patch's `before` as null."""
    state = core.DocState(None if held is None else {"document": json.dumps(held), "version": 3, "deleted": False,
                                                     "ended": 1})
    patch = {**LINEAGE, "clientid": "c", "request": 1, "user": "u", "dbid": "my-db", "parts": 1, "part": 1,
             "begun": 1, "includeBefore": True, "includeAfter": True}

    def send(ops):
        return core.apply_one(state, {**patch, "ops": json.dumps(ops)}, implicit_empty=True)

    failed = send([{"op": "add", "path": "Groups", "value": {}}, {"op": "remove", "path": ""}])
    assert failed["status"] == 3 and failed["error"] == f'op 1 (remove ""): {core.SCHEMA_KEPT}'
    # the error a schema's client reads names the schema, and moving the remove last would not help
    first = send([{"op": "remove", "path": ""}, {"op": "add", "path": "Groups", "value": {}}])
    assert first["status"] == 3 and first["error"] == f'op 0 (remove ""): {core.SCHEMA_KEPT}'
    nulled = send([{"op": "replace", "path": "", "value": None}])
    assert nulled["status"] == 3 and nulled["error"] == "a database's schema must be an object, got null"
    assert state.doc == held and state.version == (0 if held is None else 3)
    emptied = send([{"op": "replace", "path": "", "value": {}}])
    assert emptied["status"] == 1 and emptied["action"] == ("created" if held is None else "updated")
    assert state.doc == {} and json.loads(emptied["after"]) == {}


def test_a_schema_patch_that_leaves_a_declaration_learning_cannot_read_fails_with_status_3():
    """The seed's schema patch applies; the same field declared `"optional": "false"` (a string,
    which learning would read as optional) fails as a failed op does, the schema unchanged. A bad
    declaration a schema already held (from a release that did not check) blocks no other patch."""
    from entity_assets.learning import new_declaration_error

    state = core.DocState()
    patch = {**LINEAGE, "clientid": "c", "request": 1, "user": "u", "dbid": "my-db", "parts": 1, "part": 1,
             "begun": 1, "includeBefore": False, "includeAfter": True}

    def declare(spec):
        ops = [{"op": "add", "path": "Contacts/fields/homePhone", "value": spec}]
        return core.apply_one(state, {**patch, "ops": json.dumps(ops)}, implicit_empty=True,
                              check=new_declaration_error)

    assert declare({"type": "STRING", "optional": True})["status"] == 1
    failed = declare({"type": "STRING", "optional": "false"})
    assert failed["status"] == 3 and failed["error"] == "Contacts/fields/homePhone/optional: must be true or false"
    assert state.doc == {"Contacts": {"fields": {"homePhone": {"type": "STRING", "optional": True}}}}
    assert state.version == 1
    held = {"Groups": {"fields": {"groupName": {"type": "STRING", "optional": "no"}}}}
    state = core.DocState({"document": json.dumps(held), "version": 7, "deleted": False, "ended": 1})
    assert declare({"type": "STRING", "optional": True})["status"] == 1 and state.version == 8
    assert declare({"type": "STRING", "optional": 0})["status"] == 3 and state.version == 8
    # a type renamed keeps its errors: no new one; a copy of it makes one
    rename = [{"op": "move", "from": "Groups", "path": "Teams"}]
    assert core.apply_one(state, {**patch, "ops": json.dumps(rename)}, implicit_empty=True,
                          check=new_declaration_error)["status"] == 1
    copy = [{"op": "copy", "from": "Teams", "path": "Groups"}]
    failed = core.apply_one(state, {**patch, "ops": json.dumps(copy)}, implicit_empty=True, check=new_declaration_error)
    assert failed["status"] == 3 and failed["error"] == "Groups/fields/groupName/optional: must be true or false"
    # the same mistake in another type is new, named in that type, whether the held one stays or goes
    for ops in ([{"op": "add", "path": "Staff", "value": held["Groups"]}],
                [{"op": "replace", "path": "Teams/fields/groupName/optional", "value": False},
                 {"op": "add", "path": "Staff", "value": held["Groups"]}]):
        failed = core.apply_one(state, {**patch, "ops": json.dumps(ops)}, implicit_empty=True,
                                check=new_declaration_error)
        assert failed["status"] == 3 and failed["error"] == "Staff/fields/groupName/optional: must be true or false"


def test_a_document_grown_by_adds_stops_at_the_size_a_copy_may_grow_it_to():
    """Each patch of a megabyte is a valid message; the one that would take the document past
    16 MiB fails (status 3) and leaves it as it was, so no text of it outgrows an Arrow column."""
    from entity_assets.patch import MAX_DOCUMENT_BYTES

    state, statuses = core.DocState(), []
    for n in range(18):
        ops = json.dumps([{"op": "add", "path": f"/f{n}", "value": "x" * 1_000_000}])
        statuses.append(core.apply(state, ops, 1, False, False)[:2])
    assert statuses[:16] == [(1, None)] * 16
    assert statuses[16] == (3, f"the document would be over {MAX_DOCUMENT_BYTES} bytes of JSON")
    assert state.version == 16 and len(core.dumps(state.doc)) <= MAX_DOCUMENT_BYTES
    shrunk = json.dumps([{"op": "remove", "path": "/f0"}, {"op": "add", "path": "/g", "value": "y" * 500_000}])
    assert core.apply(state, shrunk, 1, False, False)[0] == 1 and state.version == 17  # measured, it fits


def test_adds_of_deep_paths_stop_at_the_limit_too(monkeypatch):
    """An add creates the parents its path names, growing the text by more than the ops' own
    length: the bound covers them, so the document never passes the limit (scaled down here),
    and a replay (`sized=False`) of what was applied gives the same document."""
    MAX_DOCUMENT_BYTES = 200_000
    monkeypatch.setattr(core, "MAX_DOCUMENT_BYTES", MAX_DOCUMENT_BYTES)
    state, applied, deep = core.DocState(), [], "/".join(["a"] * 98)
    for n in range(1_000):
        ops = core.dumps([{"op": "add", "path": f"k{n}/{deep}", "value": 1}])
        if core.apply(state, ops, 0, False, False)[0] != 1:
            break
        applied.append(ops)
    else:
        raise AssertionError("no patch failed")
    assert len(core.dumps(state.doc)) <= MAX_DOCUMENT_BYTES < len(core.dumps(state.doc)) + 800
    replay = core.DocState()
    for ops in applied:
        assert core.apply(replay, ops, 0, False, False, sized=False)[0] == 1
    assert replay.doc == state.doc


def test_a_replay_applies_what_an_older_release_applied_past_the_shifts_limit(monkeypatch):
    """`history` replays updates as they were applied: one a release before `MAX_SHIFTS` applied
    must apply again (limit scaled down here), or the history reads as missing an update."""
    from entity_assets import patch

    monkeypatch.setattr(patch, "MAX_SHIFTS", 100)
    ops = core.dumps([{"op": "add", "path": "/a/0", "value": 1}] * 3)
    state = core.DocState()
    state.doc, state.size = {"a": [0] * 50}, 110
    assert core.apply(state, ops, 0, False, False)[:2] == (
        3, "op 1 (add /a/0): the patch's inserts and removes would move over 100 array elements")
    replay = core.DocState()
    replay.doc = {"a": [0] * 50}
    assert core.apply(replay, ops, 0, False, False, sized=False)[0] == 1 and replay.doc["a"][:4] == [1, 1, 1, 0]


def test_a_copy_bounds_the_document_by_what_it_copied_not_by_a_measure():
    """Every copy serialized the whole document: one-op copies of a scalar into a 12 MB document
    cost 388 ms each. The bound grows by the value copied and the ops' text."""
    state = core.DocState()
    assert core.apply(state, json.dumps([{"op": "add", "path": "/k", "value": list(range(10_000))},
                                         {"op": "add", "path": "/s", "value": "v"}]), 1, False, False)[0] == 1
    before, copy = state.size, '[{"op":"copy","from":"/s","path":"/t"}]'
    assert core.apply(state, copy, 2, False, False)[:2] == (1, None)
    assert state.size == before + len('"t":"v",') + core.GROWTH_PER_OPS_CHARACTER * len(copy)


def test_a_document_near_the_limit_is_bounded_by_its_ops_not_measured_at_each_patch(monkeypatch):
    """Within 7 times a patch's text of the limit (scaled down here), each patch serialized the
    whole document (12 ms at 16 MB); a bound of what its ops add is enough, and the patch that
    would pass the limit still fails."""
    MAX_DOCUMENT_BYTES = 200_000
    monkeypatch.setattr(core, "MAX_DOCUMENT_BYTES", MAX_DOCUMENT_BYTES)
    state = core.DocState()
    fill = json.dumps([{"op": "add", "path": "/pad", "value": "x" * (MAX_DOCUMENT_BYTES - 40)}])
    assert core.apply(state, fill, 1, False, False)[0] == 1
    assert core.apply(state, '[{"op":"add","path":"/s","value":"v"}]', 2, False, False)[0] == 1
    bound, replace = state.size, '[{"op":"replace","path":"/s","value":"w"}]'
    assert bound + core.GROWTH_PER_OPS_CHARACTER * len(replace) > MAX_DOCUMENT_BYTES
    assert core.apply(state, replace, 3, False, False)[0] == 1
    assert state.size == bound + len('"w"')  # the value's text, not a measure
    too_much = json.dumps([{"op": "add", "path": "/t", "value": "y" * 40}])
    assert core.apply(state, too_much, 4, False, False)[:2] == (
        3, f"the document would be over {MAX_DOCUMENT_BYTES} bytes of JSON")


def test_two_part_request_yields_the_seed_complete_response():
    parts = []
    for part, (entity, first, last, path, phone) in enumerate(
        [(SALLY, "Sally", "Anderson", "phone/home", "1-222-555-1234"),
         (WILLIAM, "William", "Johnson", "homePhone", "1-222-555-9876")], start=1):
        ops = [{"op": "add", "path": "firstName", "value": first}, {"op": "add", "path": "lastName", "value": last},
               {"op": "add", "path": path, "value": phone}]
        patch = {**LINEAGE, "kafka_timestamp": 1415747086326 + part, "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd",
                 "request": 2, "user": "jsmith", "dbid": "my-db", "collection": "Contacts", "zone": "default",
                 "entity": entity, "parts": 2, "part": part, "begun": 1415747086227, "learning": False,
                 "includeBefore": True, "includeAfter": True, "ops": json.dumps(ops)}
        parts.append(core.apply_one(core.DocState(), patch))
    # parts arrive in any order and one twice: grouped by request, deduped, ordered by part
    rows = sorted([parts[1], parts[0], parts[1]], key=lambda r: (r["clientid"], r["request"], r["part"]))
    (kind, row), = core.split_complete(core.group_requests(rows), "0000000003")
    assert kind == "complete" and row["slice"] == "0000000003"
    message = json.loads(core.complete_json(row))
    CompleteResponse.model_validate(message)
    assert [r["part"] for r in message["responses"]] == [1, 2]
    assert message["ended"] == 1415747086328 and message["parts"] == 2
    assert message["responses"][1]["after"] == {"firstName": "William", "lastName": "Johnson",
                                                "homePhone": "1-222-555-9876"}
    for response in message["responses"]:
        PartialResponse.model_validate(response)


def test_a_complete_response_ends_with_the_part_processed_last_whatever_its_number():
    """Part 1 may be processed after part 2 (its `ended` later): the response's `ended` and
    Kafka coordinates are that part's, where its record's trail shows it (docs/operations.md)."""
    def part(number, ended, offset):
        return {**LINEAGE, "kafka_offset": offset, "clientid": "c", "request": 3, "user": "u", "dbid": "d",
                "stream": "entity-updates", "part": number, "parts": 2, "begun": 0, "ended": ended, "status": 1,
                "error": None, "before": None, "after": None, "includeBefore": False, "includeAfter": False}

    row = core.complete_row([part(1, 9, 40), part(2, 5, 41)], "0000000001")
    assert (row["ended"], row["kafka_offset"]) == (9, 40)
    # part 1 pending from slice 1, ended later than part 2, which completes the request in slice 2:
    # the response is in slice 2, so its coordinates are part 2's, whose trail reads slice 2
    row = core.complete_row([part(1, 9, 40), {**part(2, 5, 41), "slice": "0000000002"}], "0000000002")
    assert (row["ended"], row["kafka_offset"]) == (9, 41)
    tied = core.complete_row([part(1, 5, 40), part(2, 5, 41)], "0000000001")  # a tie: the higher part
    assert tied["kafka_offset"] == 41


def test_action_of():
    assert core.action_of(created=True, deleted=False) == "created"
    assert core.action_of(created=False, deleted=False) == "updated"
    assert core.action_of(created=False, deleted=True) == "deleted"
    # never both: a patch that would create an entity and delete it finds none
    create_and_delete = json.dumps([{"op": "add", "path": "/a", "value": 1}, {"op": "remove", "path": ""}])
    assert core.apply(core.DocState(), create_and_delete, 1, False, False)[:2] == (2, "entity does not exist")


def test_incomplete_request_stays_pending():
    part = {"clientid": "c", "request": 1, "part": 1, "parts": 2}
    assert list(core.split_complete(core.group_requests([part]), "0000000001")) == [("pending", part)]


def test_a_request_incomplete_for_its_wait_expires_from_the_slice_of_its_first_part():
    def part(number, slice_key):
        return {**LINEAGE, "slice": slice_key, "clientid": "c", "request": 7, "user": "u", "dbid": "d",
                "stream": "entity-updates", "part": number, "parts": 3, "begun": 0, "ended": number, "status": 1}

    rows = [part(1, "0000000002"), part(3, "0000000004")]
    for key in ("0000000004", "0000000005"):
        assert [kind for kind, _ in core.split_complete(core.group_requests(rows), key, 4)] == ["pending"] * 2
    assert list(core.split_complete(core.group_requests(rows), "0000000006", 4)) == [
        ("expired", {"clientid": "c", "request": 7, "parts": 3, "received": [1, 3], "since": "0000000002"})]
    assert [kind for kind, _ in core.split_complete(core.group_requests(rows), "0000000009")] == ["pending"] * 2
    # the wait never cuts short a request that is complete
    rows.append(part(2, "0000000009"))
    assert [kind for kind, _ in core.split_complete(core.group_requests(rows), "0000000009", 0)] == ["complete"]


def test_a_request_whose_parts_give_different_counts_waits_for_the_largest():
    def part(number, parts):
        return {**LINEAGE, "clientid": "c", "request": 1, "user": "u", "dbid": "d", "part": number,
                "parts": parts, "begun": 0, "ended": number, "status": 1}

    rows = [part(1, 2), part(2, 3)]
    assert [kind for kind, _ in core.split_complete(core.group_requests(rows), "0000000001")] == ["pending"] * 2
    rows.append(part(3, 3))
    (kind, row), = core.split_complete(core.group_requests(rows), "0000000002")
    assert kind == "complete" and row["parts"] == 3 and row["ended"] == 3


def test_entity_type_rows_one_per_type():
    schema = {"Contacts": {"fields": {"a": {"type": "STRING"}}}, "Groups": {"fields": {}}}
    rows = core.entity_type_rows({"clientid": "c", "request": 1, "parts": 1, "part": 1}, schema)
    assert [(r["collection"], r["part"], r["parts"]) for r in rows] == [("Contacts", 1, 2), ("Groups", 2, 2)]
    assert json.loads(rows[0]["after"]) == {"Contacts": schema["Contacts"]} and rows[0]["ops"] is None


def test_murmur2_matches_kafkas_java_client():
    # test vectors from Kafka's own UtilsTest (signed ints there)
    vectors = {b"21": -973932308, b"foobar": -790332482, b"a-little-bit-long-string": -985981536,
               b"a-little-bit-longer-string": -1486304829, b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
               b"abc": 479470107}
    for data, signed in vectors.items():
        assert murmur2(data) == signed & 0xFFFFFFFF
    assert all(0 <= partition_for(f"client{i}", 4) < 4 for i in range(100))
    partition_for.cache_clear()
    zones = ["A", "z" * 100_000]
    assert partitions_for(zones, 4) == [partition_for.__wrapped__(z, 4) for z in zones]
    assert partition_for.cache_info().currsize == 1  # a long value is hashed, not kept


def test_every_derived_stream_has_a_publisher():
    assert {s.name for s in STREAMS.values()} == {
        "entity-patches", "entity-updates", "schema-updates", "schema-learning", "partial-responses",
        "complete-responses", "zone-changes", "changes-by-device", "device-notifications"}


def test_a_patch_row_is_its_batch_fields_and_its_own():
    """Every entity_patches column comes from the batch row or from the patch (`core.explode`), once."""
    assert sorted(core.PATCH_FROM_BATCH + core.PATCH_FIELDS) == sorted(SCHEMAS["entity_patches"].names)
    assert set(core.PATCH_FROM_BATCH) <= set(SCHEMAS["entity_batches"].names)
