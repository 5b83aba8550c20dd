"""CDC ingestion adapters (seed 001): the seed's own examples, every format, every bad record."""

import pytest

from entity_assets import adapters
from entity_assets.core import loads
from entity_assets.messages import DeadLetterCode, InvalidMessage
from entity_assets.patch import apply_patch
from entity_assets.samples import encode as enc

ROW = {"USER_ID": 123, "TAX_CODE": "the-fiscal-code-123", "COINS": 300000000}
DB2_KEY = {"USER_ID": 123, "TAX_CODE": "ABCDEF12B02M100O"}


def batch(source: adapters.Source, key, value, *, topic="acme.PROD.crm.customers.ingestion", partition=0, offset=7,
          timestamp=1_700_000_000_000) -> dict:
    values = adapters.batch_values(source, "customers", topic, partition, offset, timestamp, key, value)
    return dict(zip(("clientid", "request", "user", "dbid", "begun", "parts", "patches", "learning",
                     "includeBefore", "includeAfter"), values))


def patch_of(row: dict) -> dict:
    (patch,) = loads(row["patches"])
    return patch


@pytest.mark.parametrize("fmt", ["db2", "auto"])
def test_db2_seed_examples(fmt):
    source = adapters.Source("crm", fmt)
    upsert = patch_of(batch(source, enc(DB2_KEY), enc({**DB2_KEY, "NAME": 456})))
    assert upsert == {"collection": "customers", "zone": "crm", "entity": "123_ABCDEF12B02M100O",
                      "ops": [{"op": "add", "path": "", "value": {**DB2_KEY, "NAME": 456}}]}
    delete = patch_of(batch(source, enc(DB2_KEY), enc(None)))
    assert delete["entity"] == "123_ABCDEF12B02M100O" and delete["ops"] == [{"op": "remove", "path": ""}]


@pytest.mark.parametrize("row", [{"ID": 5, "op": "d"}, {"ID": 5, "op": "c", "NAME": "x"}, {"ID": 5, "op_type": "D"}])
def test_auto_takes_a_row_with_an_op_column_but_no_envelope_for_a_db2_row(row):
    """Not Debezium's or GoldenGate's delete: the row's upsert, as `db2` reads it."""
    assert patch_of(batch(adapters.Source("crm", "auto"), enc({"ID": 5}), enc(row)))["ops"] == \
        [{"op": "add", "path": "", "value": row}]


@pytest.mark.parametrize("fmt", ["goldengate", "auto"])
def test_goldengate_seed_examples(fmt):
    source = adapters.Source("erp", fmt)
    insert = patch_of(batch(source, b"123", enc({"op_type": "I", "before": None, "after": ROW})))
    assert insert["entity"] == "123" and insert["ops"] == [{"op": "add", "path": "", "value": ROW}]
    update = patch_of(batch(source, b'"123"', enc({"op_type": "U", "before": ROW, "after": {**ROW, "COINS": 1},
                                                   "pos": 42})))
    assert update["entity"] == "123" and update["ops"][0]["value"]["COINS"] == 1
    delete = patch_of(batch(source, b"123", enc({"op_type": "D", "before": ROW, "after": None})))
    assert delete["ops"] == [{"op": "remove", "path": ""}]
    assert patch_of(batch(source, b"pk1_pk2", enc({"op_type": "D", "before": ROW})))["entity"] == "pk1_pk2"


@pytest.mark.parametrize("key, value", [
    (b"124", {"primary_keys": ["USER_ID"]}),  # the formatter's includePrimaryKeys
    (enc({"USER_ID": 124}), {}),  # a key object names the key's columns
])
def test_a_goldengate_update_of_the_key_deletes_the_entity_of_the_old_key(key, value):
    """GoldenGate sends a key update as one `U` whose `before` holds the old key: without a delete
    of that entity, the projection would keep a row the source no longer has."""
    source = adapters.Source("erp", "goldengate")
    moved = {**ROW, "USER_ID": 124}
    row = batch(source, key, enc({"op_type": "U", "before": ROW, "after": moved, "pos": "00000000000000001234", **value}))
    assert [(p["entity"], p["ops"]) for p in loads(row["patches"])] == [
        ("123", [{"op": "remove", "path": ""}]), ("124", [{"op": "add", "path": "", "value": moved}])]
    assert row["parts"] == 2  # the batch's two patches, as a native batch's `parts` counts them
    same = batch(source, key, enc({"op_type": "U", "before": moved, "after": {**moved, "COINS": 1}, **value}))
    assert [p["entity"] for p in loads(same["patches"])] == ["124"]
    # a before image without the key's columns (compressed) tells nothing
    partial = batch(source, key, enc({"op_type": "U", "before": {"COINS": 2}, "after": moved, **value}))
    assert [p["entity"] for p in loads(partial["patches"])] == ["124"]


@pytest.mark.parametrize("fmt", ["goldengate", "auto"])
def test_goldengate_row_modeled_messages_hold_the_columns_beside_the_operation(fmt):
    """The JSON formatter's `format=json_row` writes the row's columns at the top level, beside
    `table`, `op_type`, `op_ts`, `current_ts`, `pos` (and `primary_keys`, `tokens`)."""
    meta = {"table": "QASOURCE.TCUSTORD", "op_ts": "2015-11-05 18:45:36.000000",
            "current_ts": "2016-10-05T11:15:51.267000", "pos": "00000000000000002928", "tokens": {"R": "AADPkv"}}
    columns = {"CUST_CODE": "WILL", "ORDER_ID": 1, "PRODUCT": None}
    source = adapters.Source("erp", fmt, collection="table")
    insert = patch_of(batch(source, b"WILL_1", enc({**meta, "op_type": "I", **columns})))
    assert (insert["collection"], insert["ops"]) == ("TCUSTORD", [{"op": "add", "path": "", "value": columns}])
    merged = patch_of(batch(adapters.Source("erp", fmt, updates="merge"), b"WILL_1",
                            enc({**meta, "op_type": "U", "PRODUCT": "CAR"})))  # compressed: the changed columns
    assert merged["ops"] == [{"op": "add", "path": "/PRODUCT", "value": "CAR"}]
    assert patch_of(batch(source, b"WILL_1", enc({**meta, "op_type": "D", **columns})))["ops"] == [
        {"op": "remove", "path": ""}]
    with pytest.raises(InvalidMessage, match="after: field required for op_type 'I'"):
        batch(source, b"WILL_1", enc({**meta, "op_type": "I"}))  # neither a row nor an operation's after


@pytest.mark.parametrize("key, before, value", [
    (enc({"B": 2, "A": 1}), {"A": 1, "B": 2}, {"primary_keys": ["A", "B"]}),  # the key's order is not the columns'
    (b"x_y_z", {"K": "x_y", "L": "z"}, {"primary_keys": ["K", "L"]}),  # GoldenGate's text, unescaped
    (b"12.50", {"K": 12.50}, {"primary_keys": ["K"]}),  # a number as written
])
def test_a_goldengate_update_that_keeps_its_key_deletes_nothing_whatever_the_key_s_form(key, before, value):
    """The old key is compared with the new one column by column: an id made in another form than
    the record's key would delete another row, or a phantom, at every update."""
    row = batch(adapters.Source("erp", "goldengate"), key,
                enc({"op_type": "U", "before": before, "after": {**before, "V": 1}, **value}))
    assert [p["ops"][0]["op"] for p in loads(row["patches"])] == ["add"]


@pytest.mark.parametrize("fmt", ["debezium", "auto"])
def test_debezium_seed_examples(fmt):
    source = adapters.Source("shop", fmt, dbid="my-db", zone="A")
    for op in ("c", "r", "u"):
        row = batch(source, enc(DB2_KEY), enc({"op": op, "before": None, "after": ROW, "source": {"table": "T"}}))
        assert row["dbid"] == "my-db" and patch_of(row)["zone"] == "A"
        assert (row["learning"], row["includeBefore"], row["includeAfter"]) == (False, False, False)
        assert patch_of(row)["ops"] == [{"op": "add", "path": "", "value": ROW}]
    delete = patch_of(batch(source, enc(DB2_KEY), enc({"op": "d", "before": ROW, "after": None})))
    assert delete["ops"] == [{"op": "remove", "path": ""}]
    assert patch_of(batch(source, enc(DB2_KEY), None))["ops"] == [{"op": "remove", "path": ""}]  # tombstone
    with pytest.raises(InvalidMessage, match="empty value") as caught:  # compaction keeps it: no tombstone
        batch(source, enc(DB2_KEY), b"")
    assert caught.value.code == DeadLetterCode.BAD_FORMAT


OID = "65bc9fb6c485f419a7a877fe"
MONGO_KEY = enc({"schema": {"type": "struct"}, "payload": {"id": enc({"$oid": OID}).decode()}})  # Debezium's key: the _id as text


def mongo(op: str, after: dict | None = None, **more) -> bytes:
    """A Debezium MongoDB connector's value: the document is Extended JSON text."""
    return enc({"op": op, "before": None, "after": after if after is None else enc(after).decode(),
                "source": {"connector": "mongodb", "db": "shop", "collection": "products"}, **more})


@pytest.mark.parametrize("fmt", ["debezium", "auto"])
def test_debezium_mongodb_records_hold_the_document_as_extended_json(fmt):
    """Debezium's MongoDB connector writes `after` and the key's `_id` as Extended JSON text: the
    entity is the plain document, its id the `_id` as the database shows it (an ObjectId's hex)."""
    source = adapters.Source("catalog", fmt, collection="table")
    canonical = {"_id": {"$oid": OID}, "qty": {"$numberLong": "12"}, "price": {"$numberDouble": "9.5"},
                 "nan": {"$numberDouble": "NaN"}, "total": {"$numberDecimal": "10.10"}, "ok": True,
                 "at": {"$date": {"$numberLong": "631152000000"}}, "seen": {"$date": "2020-01-01T00:00:00Z"},
                 "ref": {"$binary": {"base64": "AAECAwQFBgcICQoLDA0ODw==", "subType": "04"}},
                 "raw": {"$binary": "aGk=", "$type": "00"}, "tags": [{"$numberInt": "3"}, {"nested": {"$oid": OID}}],
                 "ts": {"$timestamp": {"t": 1, "i": 2}}, "gone": {"$undefined": True},
                 "end": {"$date": "9999-12-31T23:59:59.999Z"}, "old": {"$date": {"$numberLong": "-30610224000001"}}}
    created = patch_of(batch(source, MONGO_KEY, mongo("c", canonical)))
    assert (created["entity"], created["collection"]) == (OID, "products")
    assert created["ops"] == [{"op": "add", "path": "", "value": {
        "_id": OID, "qty": 12, "price": 9.5, "nan": "NaN", "total": "10.10", "ok": True,
        "at": "1990-01-01T00:00:00.000Z", "seen": "2020-01-01T00:00:00.000Z",
        "ref": "00010203-0405-0607-0809-0a0b0c0d0e0f", "raw": "aGk=", "tags": [3, {"nested": OID}],
        "ts": {"$timestamp": {"t": 1, "i": 2}}, "gone": None,
        "end": "9999-12-31T23:59:59.999Z", "old": "0999-12-31T23:59:59.999Z"}}]  # whole milliseconds
    relaxed = {"_id": {"$oid": OID}, "qty": 13}  # change_streams_update_full: the whole document
    assert patch_of(batch(source, MONGO_KEY, mongo("u", relaxed)))["ops"][0]["value"] == {"_id": OID, "qty": 13}
    deleted = patch_of(batch(source, MONGO_KEY, mongo("d")))
    assert (deleted["entity"], deleted["ops"]) == (OID, [{"op": "remove", "path": ""}])
    # the other _id types: the same id whether the connector writes them relaxed or canonical
    for written, entity in [("1004", "1004"), ('{"$numberLong": "1004"}', "1004"), ('"sku-1"', "sku-1"),
                            ('{"$numberDouble": "1.5"}', "1.5"), ('{"a": 1, "b": "x"}', '{"a":1,"b":"x"}')]:
        assert patch_of(batch(source, enc({"id": written}), mongo("d")))["entity"] == entity
    # a relational table's `id` key of JSON-looking text is not decoded
    row = enc({"op": "c", "after": {"id": '"x"'}, "source": {"connector": "postgresql", "table": "t"}})
    assert patch_of(batch(source, enc({"id": '"x"'}), row))["entity"] == '"x"'


@pytest.mark.parametrize("key, value, code, reason", [
    (MONGO_KEY, mongo("u", None, updateDescription={"updatedFields": "{}"}), DeadLetterCode.BAD_FORMAT,
     "a MongoDB update without its document"),
    (MONGO_KEY, mongo("c", None), DeadLetterCode.BAD_FORMAT, "after: field required for op 'c'"),
    (MONGO_KEY, enc({"op": "c", "after": "[1]", "source": {"connector": "mongodb"}}), DeadLetterCode.BAD_FORMAT,
     "after: a MongoDB document is an object"),
    (MONGO_KEY, enc({"op": "c", "after": '{"_id": 1', "source": {"connector": "mongodb"}}),
     DeadLetterCode.MALFORMED_JSON, "after:"),
    (enc({"id": "null"}), mongo("d"), DeadLetterCode.BAD_FORMAT, "names no _id"),
    (MONGO_KEY, enc({"op": "c", "after": '{"_id": 1, "a": 1, "a": 2}', "source": {"connector": "mongodb"}}),
     DeadLetterCode.BAD_FORMAT, "a name repeated in one object"),
    (enc({"id": '{"$oid": "a", "$oid": "b"}'}), mongo("d"), DeadLetterCode.BAD_FORMAT, "a name repeated"),
    (enc({"id": ""}), mongo("d"), DeadLetterCode.BAD_FORMAT, "key.id: a key value must be"),
])
def test_bad_debezium_mongodb_records(key, value, code, reason):
    with pytest.raises(InvalidMessage) as caught:
        batch(adapters.Source("catalog", "debezium"), key, value)
    assert caught.value.code is code and reason in caught.value.reason, caught.value.reason


@pytest.mark.parametrize("written", [{"$numberInt": "1_000"}, {"$numberInt": " 7 "}, {"$numberInt": "\u0661\u0662"},
                                     {"$numberInt": "2147483648"}, {"$numberLong": "9223372036854775808"},
                                     {"$numberLong": "9" * 30}, {"$numberLong": "-" + "7" * 5000},
                                     {"$numberDouble": "1_0.5"}, {"$numberDouble": "nan"}])
def test_a_mongodb_number_outside_extended_json_s_grammar_or_range_stays_as_written(written):
    """Python's int() and float() would read these; no MongoDB writes them. Past 4,300 digits,
    int() refused one, and well-formed JSON was a GENERR007 "malformed JSON" dead letter."""
    assert adapters.plain({"n": written}) == {"n": written}
    assert adapters.plain({"n": {"$numberInt": "-2147483648"}, "m": {"$numberDouble": "-1.0e+10"},
                           "z": {"$numberLong": "-0000000000000000000009223372036854775808"},
                           "zeros": {"$numberLong": "0" * 5000 + "1"}, "zero": {"$numberLong": "-000"}}) == \
        {"n": -2147483648, "m": -1e10, "z": -2**63, "zeros": 1, "zero": 0}


def test_mutated_mongodb_documents_are_values_or_invalid_messages():
    """The Extended JSON inside the envelope is parsed apart from it: mutations of that text and of
    the key's `_id` text make an entity batch or a dead letter, never an error no check foresaw."""
    import random

    rng = random.Random(5)
    doc = enc({"_id": {"$oid": OID}, "at": {"$date": {"$numberLong": "-62135596800001"}}, "n": {"$numberInt": "7"},
               "u": {"$binary": {"base64": "AAECAwQFBgcICQoLDA0ODw==", "subType": "04"}}, "s": "\u00e9"}).decode()
    made = invalid = 0
    for _ in range(3000):
        after, oid = list(doc), list(enc({"$oid": OID}).decode())
        for text in (after, oid):
            for _ in range(rng.randint(0, 3)):
                if text:
                    text[rng.randrange(len(text))] = rng.choice('{}[]":,$\\ 0-9eE.aZ\ud800')
        value = enc({"op": rng.choice("cru"), "after": "".join(after), "source": {"connector": "mongodb"}})
        try:
            batch(adapters.Source("catalog"), enc({"id": "".join(oid)}), value)
            made += 1
        except InvalidMessage:
            invalid += 1
    assert made and invalid


def test_collection_table_takes_the_table_each_record_names():
    """Connectors that route several tables to one topic name each record's table."""
    source = adapters.Source("shop", "auto", collection="table")
    debezium = enc({"op": "c", "after": ROW, "source": {"db": "shop", "table": "orders"}})
    goldengate = enc({"op_type": "D", "table": "QASOURCE.TCUSTMER", "before": ROW})
    nameless = (enc({"op": "u", "after": ROW}), enc({"op_type": "U", "table": "", "after": ROW}), enc(ROW), None)
    assert patch_of(batch(source, b"1", debezium))["collection"] == "orders"
    assert patch_of(batch(source, b"1", goldengate))["collection"] == "TCUSTMER"
    assert [patch_of(batch(source, b"1", value))["collection"] for value in nameless] == ["customers"] * 4
    assert patch_of(batch(adapters.Source("shop"), b"1", debezium))["collection"] == "customers"
    flags = batch(adapters.Source("shop", learning=True, includeBefore=True, includeAfter=True), b"1", debezium)
    assert (flags["learning"], flags["includeBefore"], flags["includeAfter"]) == (True, True, True)
    with pytest.raises(ValueError, match="unknown collection"):
        adapters.Source("shop", collection="schema")


def test_kafka_connect_schema_envelope_is_unwrapped():
    key = enc({"schema": {"type": "struct"}, "payload": {"id": 5}})
    value = enc({"schema": {"type": "struct"}, "payload": {"op": "c", "after": {"id": 5, "name": "x"}}})
    patch = patch_of(batch(adapters.Source("shop", "debezium"), key, value))
    assert patch["entity"] == "5" and patch["ops"][0]["value"] == {"id": 5, "name": "x"}


def test_ops_apply_as_upsert_and_deletion():
    source = adapters.Source("shop", "debezium")
    create = patch_of(batch(source, b"1", enc({"op": "c", "after": ROW})))["ops"]
    replace = patch_of(batch(source, b"1", enc({"op": "u", "before": ROW, "after": {"COINS": 2}})))["ops"]
    delete = patch_of(batch(source, b"1", enc({"op": "d", "before": {"COINS": 2}})))["ops"]
    created = apply_patch(None, create)
    assert created.status == 1 and created.doc == ROW
    replaced = apply_patch(created.doc, replace)
    assert replaced.status == 1 and replaced.doc == {"COINS": 2}
    deleted = apply_patch(replaced.doc, delete)
    assert deleted.status == 1 and deleted.deleted
    assert apply_patch(None, delete).status == 2  # deleting a row the projection never had


def test_merge_updates_keep_the_columns_a_change_does_not_send():
    """GoldenGate with compressed updates sends the key and the changed columns only."""
    source = adapters.Source("erp", "goldengate", updates="merge")
    insert = patch_of(batch(source, b"1", enc({"op_type": "I", "after": {**ROW, "a/b~c": 1}})))["ops"]
    assert {"op": "add", "path": "/a~1b~0c", "value": 1} in insert and len(insert) == 4
    update = patch_of(batch(source, b"1", enc({"op_type": "U", "after": {"USER_ID": 123, "COINS": 5}})))["ops"]
    created = apply_patch(None, insert)
    assert created.status == 1 and created.doc == {**ROW, "a/b~c": 1}
    assert apply_patch(created.doc, update).doc == {**ROW, "a/b~c": 1, "COINS": 5}
    assert apply_patch(None, update).doc == {"USER_ID": 123, "COINS": 5}  # a first change creates the entity
    delete = patch_of(batch(source, b"1", enc({"op_type": "D", "before": ROW})))["ops"]
    assert delete == [{"op": "remove", "path": ""}]
    with pytest.raises(InvalidMessage, match="after: no column to merge"):
        batch(source, b"1", enc({"op_type": "U", "after": {}}))
    with pytest.raises(ValueError, match="unknown updates"):
        adapters.Source("erp", updates="upsert")


@pytest.mark.parametrize("fmt", ["debezium", "auto"])
def test_a_column_debezium_did_not_read_keeps_the_entity_s_value(fmt):
    """PostgreSQL with the default replica identity: an update that leaves a TOASTed column sends
    Debezium's placeholder for it (as text, a bytea's base64, an array's element); stored, it would
    overwrite the real value. The other columns are set one by one."""
    source = adapters.Source("crm", fmt)
    stored = {"id": 1, "name": "Ann", "bio": "b" * 9000, "pic": "aGk=", "tags": ["x"]}
    unread = {"bio": adapters.UNAVAILABLE_VALUE, "pic": "X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ==",
              "tags": [adapters.UNAVAILABLE_VALUE]}
    update = {"op": "u", "before": None, "after": {"id": 1, "name": "Anne", **unread}, "source": {"table": "users"}}
    ops = patch_of(batch(source, enc({"id": 1}), enc(update)))["ops"]
    assert apply_patch(stored, ops).doc == {**stored, "name": "Anne"}
    told = adapters.Source("crm", fmt, unavailable_value=None)  # a connector without the placeholder: stored as sent
    assert patch_of(batch(told, enc({"id": 1}), enc(update)))["ops"] == [{"op": "add", "path": "", "value": update["after"]}]


def test_request_keeps_kafka_order_and_client_is_the_topic():
    source = adapters.Source("crm")
    rows = [batch(source, b"1", enc({"a": 1}), partition=p, offset=o)
            for p, o in ((0, 9), (0, 10), (1, 0), (3, 2**39), (3, 2**40 - 1), (3, 2**40), (3, 2**46))]
    requests = [r["request"] for r in rows]
    assert requests == sorted(requests) and len(set(requests)) == 7 and max(requests) < 2**63
    # past offset 2^40, ids of other partitions stay apart, and the first form's ids are pinned
    assert adapters.request_id(0, 2**40) != adapters.request_id(1, 2**40) > adapters.request_id(2**21, 2**40 - 1)
    assert adapters.request_id(2, 5) == 2 * 2**40 + 5
    assert {r["clientid"] for r in rows} == {adapters.client_id("acme.PROD.crm.customers.ingestion")}
    assert adapters.client_id("a.b.ingestion") != adapters.client_id("a.c.ingestion")
    first = rows[0]
    assert (first["user"], first["dbid"], first["begun"], first["parts"]) == ("crm", "crm", 1_700_000_000_000, 1)


def test_only_a_schema_and_payload_pair_is_unwrapped_and_a_record_without_a_time_begins_at_0():
    """A row with `schema` and `payload` columns among others is a row, not Kafka Connect's
    wrapper; a record without a timestamp (-1) begins at 0, not before the epoch."""
    row = {"schema": "dbo", "payload": 5, "ID": 1}
    assert patch_of(batch(adapters.Source("crm", "db2"), b"1", enc(row)))["ops"][0]["value"] == row
    assert patch_of(batch(adapters.Source("crm", "db2"), b"1", enc({"schema": {}, "payload": row})))["ops"][0][
        "value"] == row
    two_columns = {"schema": "public", "payload": None}  # no Connect schema: a row, not a deletion
    assert patch_of(batch(adapters.Source("crm", "db2"), b"1", enc(two_columns)))["ops"][0]["value"] == two_columns
    assert patch_of(batch(adapters.Source("crm", "db2"), b"1", enc({"schema": None, "payload": None})))["ops"] == [
        {"op": "remove", "path": ""}]  # Connect's tombstone with schemas on
    nulls = {"schema": None, "payload": {"ID": 1}}  # two nullable columns so named
    assert patch_of(batch(adapters.Source("crm", "db2"), b"1", enc(nulls)))["ops"][0]["value"] == nulls
    assert batch(adapters.Source("crm", "db2"), b"1", enc(row), timestamp=-1)["begun"] == 0


def test_topic_names():
    assert adapters.parse_topic("test-tenant.PROD.system-name.test-projection.ingestion", "test-tenant.PROD.") == \
        ("system-name", "test-projection")
    assert adapters.parse_topic("crm.customers.ingestion", "") == ("crm", "customers")
    for topic, prefix in (("other.PROD.crm.customers.ingestion", "test-tenant.PROD."),
                          ("test-tenant.PROD.system-name.test-projection.ingestion", ""),
                          ("crm.customers.pr-update", ""), ("crm..ingestion", ""), ("entity-batches", "")):
        assert adapters.parse_topic(topic, prefix) is None, topic
    with pytest.raises(ValueError, match="unknown ingestion format"):
        adapters.Source("crm", "avro")


@pytest.mark.parametrize("fmt, key, value, code, reason", [
    ("goldengate", b"1", enc({"op_type": "X", "after": ROW}), DeadLetterCode.BAD_FORMAT, "op_type: input should be"),
    ("goldengate", b"1", enc({"op_type": "I"}), DeadLetterCode.BAD_FORMAT, "after: field required for op_type 'I'"),
    ("goldengate", b"1", enc({"op_type": "U", "after": [1]}), DeadLetterCode.BAD_FORMAT, "after:"),
    ("debezium", b"1", enc({"op": "t", "source": {}}), DeadLetterCode.UNSUPPORTED_TYPE, "'t' (truncate)"),
    ("auto", b"1", enc({"op": "m", "source": {}}), DeadLetterCode.UNSUPPORTED_TYPE, "'m' (message)"),
    ("goldengate", b"1", enc({"op_type": "T", "table": "S.T"}), DeadLetterCode.UNSUPPORTED_TYPE,
     "op_type: 'T' (truncate)"),
    ("auto", b"1", enc({"op_type": "T", "table": "S.T"}), DeadLetterCode.UNSUPPORTED_TYPE, "op_type: 'T' (truncate)"),
    ("debezium", b"1", enc({"before": ROW}), DeadLetterCode.BAD_FORMAT, "op: field required"),
    # auto: an envelope with an op Debezium does not have, not a DB2 row holding it whole
    ("auto", b"1", enc({"op": "x", "after": ROW}), DeadLetterCode.BAD_FORMAT, "op: input should be"),
    ("auto", b"1", enc({"op": None, "before": ROW, "after": ROW}), DeadLetterCode.BAD_FORMAT, "op: input should be"),
    ("debezium", b"1", enc({"op": "c", "after": None}), DeadLetterCode.BAD_FORMAT, "after: field required for op 'c'"),
    ("db2", b"1", enc([ROW]), DeadLetterCode.BAD_FORMAT, "a DB2 record is the row"),
    ("db2", b"1", b'{"USER_ID": ', DeadLetterCode.MALFORMED_JSON, "value:"),
    ("db2", None, enc(ROW), DeadLetterCode.BAD_FORMAT, "key: the record has no key"),
    ("db2", enc({}), enc(ROW), DeadLetterCode.BAD_FORMAT, "key: the primary key has no fields"),
    ("db2", enc({"ID": None}), enc(ROW), DeadLetterCode.BAD_FORMAT, "key.ID: a key value must be"),
    ("db2", enc({"ID": ""}), enc(ROW), DeadLetterCode.BAD_FORMAT, "key.ID: a key value must be a non-empty"),
    ("db2", b'{"ID": 1e400}', enc(ROW), DeadLetterCode.BAD_FORMAT, "beyond the range of a double"),
    ("db2", b"1", b'{"USER_ID": NaN}', DeadLetterCode.MALFORMED_JSON, "value:"),
    ("db2", b"1", b'{"USER_ID": 1e400}', DeadLetterCode.BAD_FORMAT, "beyond the range of a double"),
    ("debezium", b"1", b'{"op": "c", "after": {"A": -Infinity}}', DeadLetterCode.MALFORMED_JSON, "value:"),
    ("db2", b"\xff\xfe", enc(ROW), DeadLetterCode.BAD_FORMAT, "key: neither JSON nor UTF-8"),
    # a key that is JSON but no primary key, or JSON that does not parse, is not taken as a plain key's text
    ("db2", b'{"ID": NaN}', enc(ROW), DeadLetterCode.MALFORMED_JSON, "key:"),
    ("db2", b"null", enc(ROW), DeadLetterCode.BAD_FORMAT, "names no primary key"),
    ("db2", b'""', enc(ROW), DeadLetterCode.BAD_FORMAT, "names no primary key"),
    ("db2", b'{"schema": {}, "payload": null}', enc(ROW), DeadLetterCode.BAD_FORMAT, "names no primary key"),
    ("db2", b"  ", enc(ROW), DeadLetterCode.BAD_FORMAT, "a blank key"),
    ("db2", b'{"ID": 1,}', enc(ROW), DeadLetterCode.MALFORMED_JSON, "key:"),  # a key object, malformed
    ("db2", enc({"ID": " "}), enc(ROW), DeadLetterCode.BAD_FORMAT, "key.ID: a key value must be a non-empty"),
    # its patch would nest past what a document may: a dead letter here, not a failed explode later
    ("db2", b"1", enc({"A": [[[[]]]]}).replace(b"[[[[]]]]", b"[" * 100 + b"]" * 100),
     DeadLetterCode.BAD_FORMAT, "the row nests deeper than 100 levels"),
    ("db2", b"1", b'{"a": "' + b"x" * 1_000_001 + b'"}', DeadLetterCode.OVERSIZE, "value is 1000010 bytes"),
    # an op of another type than text is a bad op, not an error no check foresaw
    ("debezium", b"1", enc({"op": ["c"], "after": ROW}), DeadLetterCode.BAD_FORMAT, "op: input should be"),
    ("auto", b"1", enc({"op": {"x": 1}, "before": None}), DeadLetterCode.BAD_FORMAT, "op: input should be"),
    # a name repeated in one object: which value is meant cannot be told (the op, a column, a key field)
    ("debezium", b"1", b'{"op": "c", "after": {"A": 1}, "op": "d"}', DeadLetterCode.BAD_FORMAT,
     'a name repeated in one object (Detected duplicate key "op"'),
    ("db2", b"1", b'{"A": 1, "A": 2}', DeadLetterCode.BAD_FORMAT, "a name repeated in one object"),
    ("db2", b'{"ID": 1, "ID": 2}', enc(ROW), DeadLetterCode.BAD_FORMAT, "a name repeated in one object"),
    # a key nested past the parser's limit is JSON, not a plain key's text
    ("db2", b"[" * 5000 + b"]" * 5000, enc(ROW), DeadLetterCode.BAD_FORMAT, "nested deeper than a document"),
])
def test_bad_records(fmt, key, value, code, reason):
    with pytest.raises(InvalidMessage) as caught:
        batch(adapters.Source("crm", fmt), key, value)
    assert caught.value.code is code and reason in caught.value.reason, caught.value.reason


@pytest.mark.parametrize("key, entity", [
    (b"123", "123"), (b"12.50", "12.50"), (b"true", "true"), (b'"k"', "k"),  # JSON scalars: their text as written
    (b'{"ID": 1, "T": "x"}', "1_x"), (b'{"ID": 1.5, "OK": false}', "1.5_false"),
    (b'{"schema": {"type": "struct"}, "payload": {"ID": 1}}', "1"),  # Kafka Connect's wrapper, unwrapped
    (b'{"schema": {"type": "string"}, "payload": "k"}', "k"),
    (b'{"schema": {"type": "int64"}, "payload": 12}', "12"),
    (b"abc_1", "abc_1"), (b"NaN", "NaN"), (b"1e400", "1e400"),  # plain text (GoldenGate's), JSON or not
    (b"{3F2504E0-4F89-11D3-9A0C-0305E82C3301}", "{3F2504E0-4F89-11D3-9A0C-0305E82C3301}"),
    (b'"O\'Brien"_7', '"O\'Brien"_7'), (b"[A]_1", "[A]_1"), (b"{abc", "{abc"),
    # a value's own `_` (and `\\`) escaped in a key of several fields, so no two such keys join alike
    (b'{"A": "x_y", "B": "z"}', "x\\_y_z"), (b'{"A": "x", "B": "y_z"}', "x_y\\_z"),
    (b'{"A": "x\\\\", "B": "_z"}', "x\\\\_\\_z"), (b'{"A": "x_y"}', "x_y"),
    (b'{"a":1}_7', '{"a":1}_7'),  # GoldenGate's text of a key whose first field is JSON text
])
def test_an_entity_id_is_the_keys_values_or_its_text(key, entity):
    """Pinned: an entity's id may not change between releases, or its history would split."""
    assert adapters.entity_id(key)[0] == entity


def test_a_row_as_deep_as_a_document_may_be_is_exploded_and_applied():
    """100 containers, a document's limit (patch.MAX_DEPTH): one more is a dead letter (above)."""
    from entity_assets import core

    row = 0
    for _ in range(100):
        row = {"A": row}
    values = batch(adapters.Source("crm", "db2"), b"1", enc(row))
    [(_, _, entity, _, _, ops, _)] = core.explode(values["dbid"], values["patches"])
    assert entity == "1" and apply_patch(None, loads(ops)).doc == row


def test_mutated_records_are_values_or_invalid_messages_never_crashes():
    """Every byte-level mutation of the sample CDC records of each format (and of Qlik's) either
    makes an entity batch (or a registration) or raises InvalidMessage, which ingest writes as a
    dead letter with its code: no other exception (GENERR009 would mean a bug)."""
    import random

    from entity_assets import qlik, samples

    rng = random.Random(11)
    records = list(samples.CdcTraffic(rows=6, changes=1).records())
    decoder = qlik.Decoder({})
    outcomes = {"values": 0, "invalid": 0}
    for stream, key, value in records:
        source = adapters.Source(stream.split(".")[0], samples.CDC_STREAMS[stream])
        for _ in range(40):
            data = bytearray(value or b"")
            for _ in range(rng.randint(1, 3)):
                if data and rng.random() < 0.7:
                    data[rng.randrange(len(data))] = rng.randrange(256)
                elif data:
                    del data[rng.randrange(len(data)):]
            key_bytes = key.encode() if isinstance(key, str) else key
            try:
                result = adapters.batch_values(source, "p", stream, 0, 1, 1, key_bytes, bytes(data), decoder)
                if isinstance(result, qlik.Registered):
                    decoder.registry.setdefault(result.schema_id, result)
                outcomes["values"] += 1
            except InvalidMessage:
                outcomes["invalid"] += 1
    assert outcomes["values"] and outcomes["invalid"], outcomes
