"""The Qlik Replicate Avro envelope (seed 000): registration, decoding, waiting, bad envelopes."""

import datetime as dt
import decimal
import io
import json
import pickle
import time
from dataclasses import replace

import fastavro
import pytest

from entity_assets import adapters, qlik
from entity_assets.core import loads
from entity_assets.ingest import IngestionStream, Routed
from entity_assets.messages import DeadLetterCode, InvalidMessage

COLUMNS = {"EMP_ID": "long", "DEPT": "string", "NAME": "string"}
SCHEMA = qlik.data_schema("EMPLOYEES", COLUMNS)
SID = "0123456789abcdef0123456789abcdef"
MD = qlik.metadata_envelope(SID, "EMPLOYEES", COLUMNS, ["DEPT", "EMP_ID"])
ROW = {"EMP_ID": 7, "DEPT": "R&D", "NAME": "Ada"}
SOURCE = adapters.Source("hr", "qlik", dbid="hr-db")


def dt_message(operation="INSERT", data=ROW, before=None, schema_id=SID) -> bytes:
    return qlik.data_envelope(schema_id, SCHEMA, operation, data, before)


def registered() -> qlik.Registered:
    reg = qlik.Decoder({}).decode(MD)
    assert isinstance(reg, qlik.Registered)
    return reg


def test_metadata_message_registers_its_data_schema_and_primary_key():
    reg = registered()
    assert (reg.schema_id, reg.table, reg.primary_key) == (SID, "EMPLOYEES", ("DEPT", "EMP_ID"))
    assert json.loads(reg.data_schema) == SCHEMA
    assert qlik.Registered.from_row(dict(zip(qlik.REGISTRY_FIELDS, reg.values("hr")))) == reg


def test_a_primary_key_s_columns_are_in_their_key_positions_not_by_name():
    """The entity id joins the key's values in key order: by name, EMP_ID before DEPT would swap
    (`R&D_7` for `7_R&D`), and an entity's history would split at an upgrade."""
    reg = qlik.Decoder({}).decode(qlik.metadata_envelope(SID, "EMPLOYEES", COLUMNS, ["EMP_ID", "DEPT"]))
    assert reg.primary_key == ("EMP_ID", "DEPT")
    assert qlik.Decoder({SID: reg}).decode(dt_message())[1] == (7, "R&D")
    underscored = dt_message(data={**ROW, "DEPT": "R_D"})
    values = adapters.batch_values(adapters.Source("hr", "qlik"), "employees", "hr.employees.ingestion", 0, 4, 1000,
                                   None, underscored, qlik.Decoder({SID: reg}))
    assert loads(values[6])[0]["entity"] == "7_R\\_D"  # a value's own `_` escaped: ("7_R", "D") is another


def test_data_messages_decode_with_the_registered_schema():
    decoder = qlik.Decoder({SID: registered()})
    assert decoder.decode(dt_message()) == (ROW, ("R&D", 7), "EMPLOYEES", None)
    assert decoder.decode(dt_message("REFRESH")) == (ROW, ("R&D", 7), "EMPLOYEES", None)
    changed = {**ROW, "NAME": "Ada L."}
    assert decoder.decode(dt_message("UPDATE", changed, ROW)) == (changed, ("R&D", 7), "EMPLOYEES", None)
    assert decoder.decode(dt_message("DELETE", ROW)) == (None, ("R&D", 7), "EMPLOYEES", None)
    assert decoder.decode(dt_message("DELETE", None, ROW)) == (None, ("R&D", 7), "EMPLOYEES", None)


def test_an_update_of_the_primary_key_deletes_the_entity_of_the_old_key():
    """Replicate sends a key update as an UPDATE whose beforeData holds the old key: without a
    delete of that entity, the projection would keep a row the source no longer has."""
    decoder = qlik.Decoder({SID: registered()})
    moved = {**ROW, "EMP_ID": 8}
    assert decoder.decode(dt_message("UPDATE", moved, ROW)) == (moved, ("R&D", 8), "EMPLOYEES", ("R&D", 7))
    values = adapters.batch_values(SOURCE, "employees", "hr.employees.ingestion", 0, 4, 1000, None,
                                   dt_message("UPDATE", moved, ROW), decoder)
    assert [(p["entity"], p["ops"][0]["op"]) for p in loads(values[6])] == [("R&D_7", "remove"), ("R&D_8", "add")]


def test_batch_values_of_envelopes():
    decoder = qlik.Decoder({SID: registered()})
    for fmt in ("qlik", "auto"):
        source = adapters.Source("hr", fmt, dbid="hr-db")
        assert adapters.batch_values(source, "employees", "hr.employees.ingestion", 0, 3, 1000, None, MD,
                                     decoder) == registered()
        values = adapters.batch_values(source, "employees", "hr.employees.ingestion", 0, 4, 1000, b"ignored",
                                       dt_message(), decoder)
        (patch,) = loads(values[6])
        assert patch == {"collection": "employees", "zone": "hr", "entity": "R&D_7",
                         "ops": [{"op": "add", "path": "", "value": ROW}]}


def test_one_topic_of_several_tables_takes_each_message_s_table_as_its_collection():
    """Replicate can write every table to one topic; its schemas name the tables."""
    orders = qlik.metadata_envelope("f" * 32, "ORDERS", {"ID": "long"}, ["ID"])
    decoder = qlik.Decoder({SID: registered(), "f" * 32: qlik.Decoder({}).decode(orders)})
    source = adapters.Source("hr", "qlik", collection="table")
    order = qlik.data_envelope("f" * 32, qlik.data_schema("ORDERS", {"ID": "long"}), "INSERT", {"ID": 1})
    got = [loads(adapters.batch_values(source, "all", "hr.all.ingestion", 0, offset, 1000, b"k", value,
                                       decoder)[6])[0]
           for offset, value in enumerate((dt_message(), order, dt_message("DELETE", ROW)))]
    assert [(p["collection"], p["entity"]) for p in got] == [("EMPLOYEES", "R&D_7"), ("ORDERS", "1"),
                                                            ("EMPLOYEES", "R&D_7")]


def test_a_topic_s_data_messages_after_its_metadata_message_decode_at_once():
    """Replicate writes a table's metadata message before its data: a task that has read it
    holds none of the data that follows; the registry of the slices before is left as it was."""
    before: dict = {}
    stream = IngestionStream(SOURCE, "employees", registry=before)
    with pytest.raises(qlik.SchemaPending):
        stream.values_of("hr.employees.ingestion", 0, 0, 1000, None, dt_message())
    assert stream.values_of("hr.employees.ingestion", 0, 1, 1000, None, MD) == Routed(
        "avro_schemas", registered().values("hr"))
    assert loads(stream.values_of("hr.employees.ingestion", 0, 2, 1000, None, dt_message())[6])[0]["entity"] == "R&D_7"
    assert before == {}


def test_an_unknown_schema_waits_and_survives_pickling():
    with pytest.raises(qlik.SchemaPending) as caught:
        qlik.Decoder({}).decode(dt_message())
    assert caught.value.code is DeadLetterCode.SCHEMA_PENDING and SID in caught.value.reason
    assert pickle.loads(pickle.dumps(caught.value)).schema_id == SID


def test_a_self_describing_data_message_needs_no_registry_and_keys_by_the_kafka_key():
    message = io.BytesIO()
    fastavro.schemaless_writer(message, fastavro.parse_schema(SCHEMA),
                               {"data": ROW, "beforeData": None,
                                "headers": {"operation": "INSERT", "changeSequence": "1", "timestamp": "t",
                                            "streamPosition": "p", "transactionId": "x"}})
    raw = io.BytesIO()
    fastavro.schemaless_writer(raw, fastavro.parse_schema(qlik.ENVELOPE_SCHEMA),
                               {"magic": qlik.MAGIC, "type": "DT", "headers": None, "messageSchemaId": None,
                                "messageSchema": json.dumps(SCHEMA), "message": message.getvalue()})
    values = adapters.batch_values(SOURCE, "employees", "t", 0, 0, 0, b"emp-7", raw.getvalue())
    assert loads(values[6])[0]["entity"] == "emp-7"
    by_table = adapters.batch_values(replace(SOURCE, collection="table"), "employees", "t", 0, 0, 0, b"emp-7",
                                     raw.getvalue())
    assert loads(by_table[6])[0]["collection"] == "employees"  # no registered schema names its table


def test_avro_values_become_json_values():
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    assert qlik.plain({"b": b"\x00\x01", "d": decimal.Decimal("1.10"), "t": when, "l": [dt.date(2026, 1, 2)]}) == \
        {"b": "AAE=", "d": "1.10", "t": "2026-01-02T03:04:05+00:00", "l": ["2026-01-02"]}


def _envelope(**fields) -> bytes:
    out = io.BytesIO()
    record = {"magic": qlik.MAGIC, "type": "DT", "headers": None, "messageSchemaId": SID, "messageSchema": None,
              "message": b"", **fields}
    fastavro.schemaless_writer(out, fastavro.parse_schema(qlik.ENVELOPE_SCHEMA), record)
    return out.getvalue()


@pytest.mark.parametrize("raw, reason", [
    (b'{"op": "c"}', "not a Replicate envelope"),
    (MD[:20], "envelope: not decodable"),
    (_envelope(messageSchemaId=None), "exactly one of messageSchema and messageSchemaId"),
    (_envelope(type="XX"), "type: input should be 'MD' or 'DT'"),
    (_envelope(message=b"\x02"), "data message: not decodable"),
    (MD + b"\x00", "envelope: 1 bytes after its value"),
    (dt_message("INSERT", None, ROW), "data: field required for operation 'INSERT'"),
    (dt_message("INSERT", None, None), "neither data nor beforeData"),
    (dt_message("INSERT", {**ROW, "DEPT": None}), "primary key column(s) DEPT missing, null, blank"),
    (dt_message("INSERT", {**ROW, "DEPT": " "}), "primary key column(s) DEPT missing, null, blank"),
    (qlik.metadata_envelope("x", "T", {"A": "no-such-type"}, []), "dataSchema: not an Avro schema"),
])
def test_bad_envelopes(raw, reason):
    with pytest.raises(InvalidMessage) as caught:
        qlik.Decoder({SID: registered()}).decode(raw)
    assert caught.value.code is DeadLetterCode.BAD_FORMAT and reason in caught.value.reason, caught.value.reason


# A metadata envelope whose own schema is an array of nulls, and a block count of 10^8: decoded, a
# list of 10^8 Nones (800 MB); with a record of no fields and 10^12, memory until the worker dies.
ZERO_BYTE_ITEMS = (b'atMSG\x04MD\x00\x00\x02\xda\x01{"type": "record", "name": "M", "fields": [{"name": "schemaId", '
                   b'"type": {"type": "array", "items": "null"}}]}\n\x80\x84\xaf_\x00')


@pytest.mark.parametrize("items", [
    '"null"',
    '{"type": "record", "name": "E", "fields": [{"name": "x", "type": "null"}]}',
    '{"type": "fixed", "name": "F", "size": 0}',
])
def test_an_array_of_items_that_take_no_bytes_is_refused_before_decoding(items):
    with pytest.raises(InvalidMessage) as caught:
        qlik.Decoder({}).decode(ZERO_BYTE_ITEMS)
    assert caught.value.code is DeadLetterCode.BAD_FORMAT and "items that take no bytes" in caught.value.reason
    schema = {"type": "record", "name": "R", "fields": [
        {"name": "ok", "type": {"type": "array", "items": ["null", "int"]}},
        {"name": "nested", "type": {"type": "map", "values": {"type": "array", "items": json.loads(items)}}}]}
    with pytest.raises(InvalidMessage, match="items that take no bytes"):
        qlik._schema(json.dumps(schema), "dataSchema")
    schema["fields"].pop()
    assert qlik._schema(json.dumps(schema), "dataSchema")


def doubling(n: int) -> dict:
    """R0 has no fields, and each Ri two fields of R(i-1): a value of Rn is 2^n records out of no bytes."""
    if n == 0:
        return {"type": "record", "name": "R0", "fields": []}
    return {"type": "record", "name": f"R{n}", "fields": [{"name": "a", "type": doubling(n - 1)},
                                                          {"name": "b", "type": f"R{n - 1}"}]}


def test_a_schema_whose_value_doubles_per_level_is_a_dead_letter():
    """A 2,365-byte data message of such an R20 decoded into 2^20 dicts: 9 s and 549 MB, twice
    that per level more; walking an array of them for items that take no bytes was as long."""
    schema = qlik.data_schema("T", {"A": "long"})
    schema["fields"][0]["type"], schema["fields"][1]["type"] = ["null", doubling(20)], ["null", "R20"]
    for raw in (_envelope(messageSchemaId=None, messageSchema=json.dumps(schema), message=b"\x02\x00\x00"),
                _envelope(type="MD", messageSchemaId=None, messageSchema=json.dumps(
                    {"type": "record", "name": "M", "fields": [{"name": "x", "type": doubling(20)}]}))):
        with pytest.raises(InvalidMessage) as caught:
            qlik.Decoder({}).decode(raw)
        assert caught.value.code is DeadLetterCode.BAD_FORMAT and "more than 10,000 values" in caught.value.reason
    started = time.process_time()
    with pytest.raises(InvalidMessage, match="items that take no bytes"):
        qlik._schema(json.dumps({"type": "array", "items": doubling(22)}), "dataSchema")
    assert time.process_time() - started < 1
    assert qlik._schema(json.dumps(doubling(12)), "dataSchema")  # 8,191 records: within the bound


@pytest.mark.parametrize("kind, items, what", [("array", "items", "an array of items"),
                                               ("map", "values", "a map of entries")])
def test_items_that_decode_into_many_values_a_byte_are_refused(kind, items, what):
    """A boolean beside 2^4 empty records: each byte of a 1 MB array or map a dozen values more."""
    item = {"type": "record", "name": "I", "fields": [{"name": "b", "type": "boolean"},
                                                      {"name": "r", "type": doubling(4)}]}
    schema = {"type": "record", "name": "M", "fields": [{"name": "x", "type": {"type": kind, items: item}}]}
    with pytest.raises(InvalidMessage, match=f"{what} that decode into more than 4 values a byte"):
        qlik._schema(json.dumps(schema), "dataSchema")
    item["fields"][1]["type"] = {"type": "record", "name": "W", "fields": [{"name": "e", "type": doubling(0)}]}
    assert qlik._schema(json.dumps(schema), "dataSchema")  # an item of a boolean and 3 records: 4 values a byte


def test_named_types_of_a_top_level_union_are_checked():
    """fastavro keeps a schema's named types on a top-level record only: under a union, an
    array of empty records went unchecked, and a 99-byte envelope decoded into 4M of them."""
    schema = json.dumps([{"type": "record", "name": "E", "fields": []}, {"type": "array", "items": "E"}])
    raw = _envelope(messageSchemaId=None, messageSchema=schema, message=b"\x02\x80\x89\x7a\x00")  # 10^6 items
    with pytest.raises(InvalidMessage) as caught:
        qlik.Decoder({}).decode(raw)
    assert caught.value.code is DeadLetterCode.BAD_FORMAT and "items that take no bytes" in caught.value.reason
    for schema in ("[]", '{"type": "array", "items": []}'):  # a union of no branches: no value, nothing decodes
        with pytest.raises(InvalidMessage) as caught:
            qlik.Decoder({}).decode(_envelope(messageSchemaId=None, messageSchema=schema, message=b"\x02\x00"))
        assert caught.value.code is DeadLetterCode.BAD_FORMAT and "not decodable" in caught.value.reason


def test_a_value_nested_hundreds_of_levels_deep_is_a_dead_letter():
    """Not recursive, yet deep: converting its value, or walking its schema, went past Python's
    recursion limit, an error no check foresaw (GENERR009) instead of the producer's."""
    column, value = "long", 1
    for _ in range(500):
        column, value = {"type": "array", "items": column}, [value]
    schema = qlik.data_schema("DEEP", {"X": column})
    decoder = qlik.Decoder({"d" * 32: qlik.Registered("d" * 32, json.dumps(schema), "DEEP")})
    with pytest.raises(InvalidMessage) as caught:
        decoder.decode(qlik.data_envelope("d" * 32, schema, "INSERT", {"X": value}))
    assert caught.value.code is DeadLetterCode.BAD_FORMAT and "nested deeper" in caught.value.reason


RECURSIVE = '{"type": "record", "name": "N", "fields": [{"name": "next", "type": ["null", "N"]}]}'


@pytest.mark.parametrize("schema", [
    RECURSIVE,
    '{"type": "record", "name": "A", "namespace": "x", "fields": [{"name": "b", "type": {"type": "record", '
    '"name": "B", "fields": [{"name": "a", "type": {"type": "map", "values": {"type": "array", "items": "x.A"}}}]}}]}',
])
def test_a_recursive_schema_is_a_dead_letter_not_a_crashed_worker(schema):
    """fastavro decodes a level per nested value in C: a 20 KB message of them overflowed the
    stack and killed the run's process (signal 11) at every run of its slice."""
    raw = _envelope(messageSchemaId=None, messageSchema=RECURSIVE, message=b"\x02" * 20_000 + b"\x00")
    with pytest.raises(InvalidMessage) as caught:
        qlik.Decoder({}).decode(raw)
    assert caught.value.code is DeadLetterCode.BAD_FORMAT and "contains itself" in caught.value.reason
    with pytest.raises(InvalidMessage, match="contains itself"):
        qlik._schema(schema, "dataSchema")
    # a type used in many places, and deeply, is no recursion, and is walked once per name
    fields = [{"name": f"f{i}", "type": "T0" if i else {"type": "record", "name": "T0", "fields": [
        {"name": "v", "type": "long"}]}} for i in range(40)]
    for depth in range(1, 30):
        fields = [{"name": f"g{i}", "type": f"T{depth}" if i else {"type": "record", "name": f"T{depth}",
                                                                   "fields": fields}} for i in range(3)]
    assert qlik._schema(json.dumps({"type": "record", "name": "R", "fields": fields}), "dataSchema")


def test_the_registry_before_a_slice_holds_each_id_s_first_registration(tmp_path):
    """Replicate sends a table's metadata again at each restart: the registry reads the ids, then
    the rows of each id's first registration, not every repeat's schema text."""
    from entity_assets.ingest import registry_before
    from entity_assets.storage import DeltaRsEngine, FileWriter
    from entity_assets.tables import SCHEMAS

    engine, table = DeltaRsEngine(str(tmp_path)), "avro_schemas"
    engine.ensure(table, SCHEMAS[table])
    registrations = {1: [("a", "A1"), ("b", "B1")], 2: [("a", "A2"), ("c", "C2")], 3: [("b", "B3")],
                     4: [("d", "D4")]}  # slice 3: a restart's repeat only
    for seq, rows in registrations.items():
        key = f"{seq:010d}"
        writer = FileWriter(table, engine.uri(table), SCHEMAS[table], key)
        for schema_id, text in rows:
            writer.append({"slice": key, "kafka_topic": "t", "kafka_partition": 0, "kafka_offset": seq,
                           "kafka_timestamp": 1, **dict(zip(qlik.REGISTRY_FIELDS, qlik.Registered(
                               schema_id, text, "T", ("ID",)).values("hr")))})
        engine.replace_slice(table, SCHEMAS[table], writer.close(), key)
    reads, read = [], engine.read
    engine.read = lambda *a, **k: reads.append(k) or read(*a, **k)
    registry = registry_before(engine, "0000000004")
    assert {schema_id: r.data_schema for schema_id, r in registry.items()} == {"a": "A1", "b": "B1", "c": "C2"}
    schemas_read = [k["where"]["slice"] for k in reads if "dataSchema" in (k.get("columns") or [])]
    assert sorted(schemas_read) == ["0000000001", "0000000002"]  # not slice 3, its repeats' schema text
    assert registry["a"].primary_key == ("ID",) and registry_before(engine, "0000000001") == {}


def test_a_decimal_past_308_digits_is_a_dead_letter_not_minutes_of_a_task():
    """fastavro converts a decimal in the square of its bytes: a 1 MB record's one decimal held its
    task 90 s, at every run of the slice."""
    amount = {"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": 2}
    sid = "f" * 32
    decoder = qlik.Decoder({sid: qlik.Registered(sid, json.dumps(qlik.data_schema("T", {"ID": "long", "AMOUNT": amount})),
                                                 "T", ("ID",))})

    def insert(value: bytes):  # written as the bytes they are, read with the registered decimal
        return decoder.decode(qlik.data_envelope(sid, qlik.data_schema("T", {"ID": "long", "AMOUNT": "bytes"}),
                                                 "INSERT", {"ID": 1, "AMOUNT": value}))

    row, *_ = insert((12345).to_bytes(2, "big"))
    assert qlik.plain(row) == {"ID": 1, "AMOUNT": "123.45"}
    assert qlik.plain(insert(b"\x7f" * qlik.MAX_DECIMAL_BYTES)[0])["AMOUNT"].endswith("E+305")  # 308 digits
    with pytest.raises(InvalidMessage, match=f"a decimal of 100000 bytes, past {qlik.MAX_DECIMAL_BYTES}") as caught:
        insert(b"\x7f" * 100_000)
    assert caught.value.code is DeadLetterCode.BAD_FORMAT


@pytest.mark.parametrize("rows", [1, 2, 30])
def test_the_cdc_sample_sends_the_qlik_metadata_message_after_some_data_however_few_rows(rows):
    """`produce cdc --rows 1` sent no metadata message: its data waited, then became dead letters."""
    from entity_assets import samples

    for stream in (s for s, fmt in samples.CDC_STREAMS.items() if fmt == "qlik"):
        keys = [key for s, key, _ in samples.CdcTraffic(rows=rows).records() if s == stream]
        assert keys.count("metadata") == 1 and 0 < keys.index("metadata") <= 5


def test_a_column_named_by_a_lone_surrogate_is_the_producer_s_error_not_ours():
    """The schema's JSON text may escape one (`\\ud800`), which no UTF-8 message can hold: GENERR001,
    not the GENERR009 of an error no check foresaw."""
    schema = qlik.data_schema("ODD", {"\ud800": "long"})
    decoder = qlik.Decoder({"e" * 32: qlik.Registered("e" * 32, json.dumps(schema), "ODD")})
    with pytest.raises(InvalidMessage) as caught:
        adapters.batch_values(SOURCE, "odd", "hr.odd.ingestion", 0, 1, 1000, b"k",
                              qlik.data_envelope("e" * 32, schema, "INSERT", {"\ud800": 1}), decoder)
    assert caught.value.code is DeadLetterCode.BAD_FORMAT and "no Unicode" in caught.value.reason, caught.value
