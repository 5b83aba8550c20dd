"""Batch message encoding gives the per-row encoder's text, byte for byte."""

import itertools

import pyarrow as pa
import pytest

from entity_assets import core, encode, publish
from entity_assets.tables import SCHEMAS

STRINGS = [None, "abc", 'q"uote', "back\\slash", "new\nline", "é😀", "ctl\x01", "", "tab\tand\x1f"]


def _rows():
    flags = [True, False, None]
    for i, (status, before, after, learning) in enumerate(itertools.product([1, 2, 3], flags, flags, flags)):
        text = STRINGS[i % len(STRINGS)]
        yield {"slice": "s", "kafka_topic": "entity-batches", "kafka_partition": 0, "kafka_offset": i, "kafka_timestamp": 5,
               "clientid": text if i % 3 == 0 else f"client-{i}", "request": i, "user": text, "dbid": text or "db",
               "collection": STRINGS[(i + 1) % len(STRINGS)], "zone": None if i % 4 else "A", "entity": f"e{i}",
               "parts": None if i % 5 == 0 else 2, "part": 1, "begun": None if i % 7 == 0 else 10**12,
               "ops": None if i % 6 == 0 else '[{"op":"add","path":"a","value":"x\\"y"}]',
               "learning": learning, "includeBefore": before, "includeAfter": after, "ended": 10**12 + i,
               "status": status, "error": None if status == 1 else STRINGS[i % 3], "before": None if i % 2 else '{"a":1}',
               "after": None if i % 3 == 1 else '{"b":[1,2]}', "action": None, "subjectZone": "A"}


def test_result_texts_are_result_json_of_each_row():
    rows = list(_rows())
    table = pa.Table.from_pylist(rows, schema=SCHEMAS["entity_updates"])
    assert encode.result_texts(table).to_pylist() == [core.result_json(r) for r in table.to_pylist()]


def test_result_texts_take_the_fast_path_on_clean_rows_and_read_chunked_columns():
    rows = [{**r, "clientid": "c", "user": "u", "dbid": "db", "collection": "Contacts", "zone": "A",
             "error": None if r["status"] == 1 else "boom"} for r in _rows()]
    half = len(rows) // 2
    table = pa.concat_tables([pa.Table.from_pylist(part, schema=SCHEMAS["entity_updates"])
                              for part in (rows[:half], rows[half:])])
    assert table.column("dbid").num_chunks == 2
    assert encode.result_texts(table).to_pylist() == [core.result_json(r) for r in table.to_pylist()]


@pytest.mark.parametrize("special", ['"', "\\", "\n", "\x01", "\x1f"])
def test_a_string_column_whose_only_special_character_is_one_json_escapes_is_escaped(special):
    """`DOMAIN\\bob` alone in clean rows: the fast path (quotes around the bytes) would publish
    `\\b`, a backspace to a consumer."""
    rows = [{**r, "clientid": "c", "user": f"DOMAIN{special}bob", "dbid": "db", "collection": "Contacts",
             "zone": "A", "error": None if r["status"] == 1 else "boom"} for r in _rows()]
    table = pa.Table.from_pylist(rows, schema=SCHEMAS["entity_updates"])
    assert encode.result_texts(table).to_pylist() == [core.result_json(r) for r in table.to_pylist()]


def test_schema_learning_rows_always_carry_after():
    rows = [{**r, "kind": "entity", "includeAfter": False, "status": 1} for r in _rows()]
    table = pa.Table.from_pylist(rows, schema=SCHEMAS["schema_learning"])
    assert encode.result_texts(table).to_pylist() == [core.result_json(r) for r in table.to_pylist()]


def test_an_entity_type_message_keeps_its_update_s_flags_and_never_has_a_before():
    """It has "the same header fields as the schema-updates messages" (the seed): includeAfter
    was kept and includeBefore dropped, to leave `before` out."""
    update = {"dbid": "db", "clientid": "c", "request": 2, "user": "u", "begun": 1, "parts": 1, "part": 1,
              "status": 1, "ended": 5, "ops": "[]", "before": '{"Old":{}}', "after": "{}", "error": None,
              "includeBefore": True, "includeAfter": True, "learning": False}
    rows = core.entity_type_rows(update, {"Contacts": {"fields": {}}, "Groups": {"fields": {}}})
    texts = [core.result_json(r) for r in rows]
    assert all('"includeBefore":true' in t and '"includeAfter":true' in t and '"before"' not in t for t in texts)
    table = pa.Table.from_pylist([{**r, "slice": "s"} for r in rows], schema=SCHEMAS["schema_learning"])
    assert encode.result_texts(table).to_pylist() == texts


def test_an_entity_type_message_leaves_its_collection_out_and_an_entity_message_keeps_it():
    rows = [{**r, "kind": [core.ENTITY_TYPE, "entity", None][i % 3], "status": 1} for i, r in enumerate(_rows())]
    table = pa.Table.from_pylist(rows, schema=SCHEMAS["schema_learning"])
    texts = encode.result_texts(table).to_pylist()
    assert texts == [core.result_json(r) for r in table.to_pylist()]
    for row, text in zip(rows, texts):
        has = '"collection":' in text
        assert has == (row["kind"] != core.ENTITY_TYPE and row["collection"] is not None), text


def test_no_rows_no_texts():
    assert encode.result_texts(SCHEMAS["entity_updates"].empty_table()).to_pylist() == []


def test_complete_texts_are_complete_json_of_each_row():
    rows = [{**r, "responses": f"[{core.result_json(r)}]"} for r in _rows()]
    table = pa.Table.from_pylist(rows, schema=SCHEMAS["complete_responses"])
    assert encode.complete_texts(table).to_pylist() == [core.complete_json(r) for r in table.to_pylist()]


def test_patch_texts_are_patch_json_of_each_row():
    rows = [{**r, "bucket": 3} for r in _rows()]
    table = pa.Table.from_pylist(rows, schema=SCHEMAS["entity_patches"])
    assert encode.patch_texts(table).to_pylist() == [core.patch_json(r) for r in table.to_pylist()]


def test_device_messages_made_a_batch_at_a_time_are_the_per_row_ones():
    changes = [{"dbid": STRINGS[i % len(STRINGS)] or "db", "collection": "Contacts", "zone": STRINGS[i % 4],
                "entity": f"e{i}", "notification": f"n{i}", "action": ["created", None][i % 2],
                "ended": None if i % 5 == 0 else i, "device": f"d{i}", "user": "u"} for i in range(30)]
    notifications = [{"slice": "s", "dbid": "db", "user": STRINGS[i % len(STRINGS)], "device": f"d{i}", "count": i,
                      "begun": None if i % 3 else i, "ended": i} for i in range(30)]
    for table, rows in (("changes_by_device", changes), ("device_notifications", notifications)):
        stream = publish.STREAMS[table]
        data = pa.Table.from_pylist(rows, schema=SCHEMAS[table])
        assert stream.texts(data).to_pylist() == [stream.encode(r) for r in data.to_pylist()]
        assert stream.keys(data).to_pylist() == [stream.key(r) for r in data.to_pylist()]


def test_every_batch_encoded_stream_gives_the_per_row_keys_and_texts():
    rows = [{**r, "status": 1 if r["status"] == 1 or "kind" in r else r["status"], "kind": None if i % 2 else "entity",
             "entity": [None, "", f"e{i}"][i % 3], "stream": "entity-updates", "bucket": 1,
             "responses": f"[{core.result_json(r)}]"} for i, r in enumerate(_rows())]
    for table, stream in publish.STREAMS.items():
        if stream.texts is None or table.startswith("device") or table.startswith("changes"):
            continue
        data = pa.Table.from_pylist(rows, schema=SCHEMAS[table])
        if table == "schema_learning":
            data = data.filter(pa.compute.equal(data.column("status"), 1))
        if stream.key is publish.request_key_of:  # every request has a client id (validated at ingest)
            data = data.filter(pa.compute.is_valid(data.column("clientid")))
        plain = data.to_pylist()
        assert stream.keys(data).to_pylist() == [stream.key(r) for r in plain], table
        assert stream.texts(data).to_pylist() == [stream.encode(r) for r in plain], table
