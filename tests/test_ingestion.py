"""CDC ingestion topics through the real broker, Spark and Delta: records of the three formats
become entity batches and take the native path to updates, state and responses; bad ones
reach dead letters."""

import json

import pytest

from entity_assets import adapters, qlik, samples
from entity_assets.ingest import waits_for
from entity_assets.kafka_io import ensure_topics, produce
from entity_assets.samples import encode as enc
from entity_assets.slices import slice_key as K
from entity_assets.trace import format_trail, trace
from resources.kafka import IngestionSource

ROW = {"USER_ID": 1, "NAME": "Mario"}


def states(pipeline) -> dict[tuple, dict]:
    return {(r["dbid"], r["collection"], r["zone"], r["entity"]): r for r in pipeline.read("entities").to_pylist()}


def test_cdc_records_become_entities_and_bad_ones_dead_letters(make_pipeline):
    pipeline = make_pipeline(ingestion={"crm": IngestionSource(format="debezium", dbid="my-db", zone="A"),
                                        "erp": IngestionSource(format="goldengate", updates="merge",
                                                               includeBefore=True, includeAfter=True),
                                        "*": IngestionSource()})
    crm, erp, legacy, ignored = (pipeline.topic(t) for t in ("crm.customers.ingestion", "erp.accounts.ingestion",
                                                              "legacy.users.ingestion", "crm.customers.pr-update"))
    ensure_topics(pipeline.kafka.config(), [crm, erp, legacy, ignored], 2)
    config = pipeline.kafka.config()
    key = enc({"USER_ID": 1})
    # One key changed 40 times within milliseconds: the fold must keep the topic's order.
    produce(config, crm, [(key, enc({"op": "c", "after": ROW, "source": {"table": "CUSTOMERS"}}))]
            + [(key, enc({"op": "u", "before": ROW, "after": {**ROW, "N": n}})) for n in range(40)]
            + [(enc({"USER_ID": 2}), enc({"op": "r", "after": {"USER_ID": 2}})),
               (enc({"USER_ID": 2}), enc({"op": "d", "before": {"USER_ID": 2}})),
               (enc({"USER_ID": 2}), None),  # the tombstone after a delete: the entity is already gone
               (enc({"USER_ID": 3}), enc({"op": "t", "source": {}})),
               (enc({"USER_ID": 4}), b'{"op": "c", "after": ')])
    produce(config, erp, [(b"A1_7", enc({"op_type": "I", "before": None, "after": {"ID": "A1", "N": 7}})),
                          (b"A1_7", enc({"op_type": "U", "after": {"N": 8}, "pos": 2}))])  # changed columns only
    produce(config, legacy, [(enc({"ID": 5, "CODE": "x"}), enc({"ID": 5, "CODE": "x", "NAME": "Lara"})),
                             (enc({"ID": 6, "CODE": "y"}), enc({"ID": 6}))])
    produce(config, ignored, [(key, enc({"operationType": "INSERT"}))])

    [run] = pipeline.tick_and_run()
    assert run.success
    manifest = pipeline.manifest(1)
    assert {r.topic for r in manifest.ranges if r.count} == {crm, erp, legacy}

    batches = pipeline.read("entity_batches").to_pylist()
    assert len(batches) == 41 + 3 + 2 + 2
    assert {b["kafka_topic"] for b in batches} == {crm, erp, legacy}
    assert {b["clientid"] for b in batches if b["kafka_topic"] == crm} == {adapters.client_id(crm)}

    dead = pipeline.read("dead_letters").to_pylist()
    assert sorted((d["stream"], d["kafka_topic"], d["code"]) for d in dead) == [
        ("ingestion", crm, "GENERR002"), ("ingestion", crm, "GENERR007")]
    assert all(d["kafka_key"] and d["value"] and d["reason"] for d in dead)

    now = states(pipeline)
    mario = now[("my-db", "customers", "A", "1")]
    assert json.loads(mario["document"]) == {**ROW, "N": 39} and mario["version"] == 41
    assert now[("my-db", "customers", "A", "2")]["deleted"]
    assert json.loads(now[("erp", "accounts", "erp", "A1_7")]["document"]) == {"ID": "A1", "N": 8}
    assert json.loads(now[("legacy", "users", "legacy", "5_x")]["document"])["NAME"] == "Lara"
    assert json.loads(now[("legacy", "users", "legacy", "6_y")]["document"]) == {"ID": 6}

    updates = pipeline.read("entity_updates").to_pylist()
    assert len(updates) == 41 + 2 + 2 + 2 and {u["status"] for u in updates} == {1}
    assert sorted(u["action"] for u in updates if u["entity"] == "2") == ["created", "deleted"]
    # erp asks for the document before and after each change, as a projection-update message holds them
    v1, v2 = {"ID": "A1", "N": 7}, {"ID": "A1", "N": 8}
    assert [(u["before"] and json.loads(u["before"]), json.loads(u["after"])) for u in updates
            if u["entity"] == "A1_7"] == [(None, v1), (v1, v2)]
    assert {(u["before"], u["after"]) for u in updates if u["kafka_topic"] != erp} == {(None, None)}
    responses = pipeline.read("partial_responses").to_pylist()
    assert sorted(r["status"] for r in responses if r["entity"] == "2") == [1, 1, 2]  # the tombstone's
    assert pipeline.read("complete_responses").num_rows == len(batches)

    # A record's trail runs from its ingestion topic to the entity it changed.
    first = next(b for b in batches if b["kafka_topic"] == erp)
    trail = trace(pipeline.engine, erp, first["kafka_partition"], first["kafka_offset"])
    assert trail.rows["entity_batches"][0]["user"] == "erp"
    assert [s["entity"] for s in trail.states["entities"]] == ["A1_7"]

    # The next slice continues the same entities.
    produce(config, crm, [(key, enc({"op": "u", "before": ROW, "after": {"USER_ID": 1, "NAME": "Luigi"}}))])
    [run] = pipeline.tick_and_run()
    assert run.success
    mario = states(pipeline)[("my-db", "customers", "A", "1")]
    assert json.loads(mario["document"])["NAME"] == "Luigi" and mario["version"] == 42


def test_ingestion_sources_come_from_the_environment(monkeypatch):
    from entity_assets.definitions import build_resources

    monkeypatch.setenv("ENTITY_ASSETS_INGESTION", "crm=debezium, *=auto")
    assert {s: v.format for s, v in build_resources()["kafka"].ingestion.items()} == {"crm": "debezium", "*": "auto"}
    monkeypatch.setenv("ENTITY_ASSETS_INGESTION", '{"shop": {"format": "debezium", "collection": "table", '
                                                  '"includeAfter": true}}')
    [(system, source)] = build_resources()["kafka"].sources().items()
    assert (system, source.format, source.collection, source.includeAfter) == ("shop", "debezium", "table", True)
    monkeypatch.setenv("ENTITY_ASSETS_INGESTION", "")
    assert build_resources()["kafka"].ingestion == {}


def test_without_sources_no_ingestion_topic_is_read(make_pipeline):
    pipeline = make_pipeline(ingestion={})
    topic = pipeline.topic("crm.customers.ingestion")
    ensure_topics(pipeline.kafka.config(), [topic], 1)
    produce(pipeline.kafka.config(), topic, [(b"1", enc({"ID": 1}))])
    assert pipeline.tick() == []
    assert pipeline.kafka.input_stream(topic) is None


def test_qlik_data_waits_for_its_metadata_message_then_applies(make_pipeline):
    """Seed 000: a data message read before its schema's metadata message waits for it: within
    the slice it is applied at once; across slices it waits in `schema_waits`, is a dead letter
    (EA-SCHEMA-UNKNOWN) once it has waited `schema_wait_slices` slices, and the slice that brings
    the schema applies it."""
    pipeline = make_pipeline(schema_wait_slices=1)
    topic = pipeline.topic("hr.employees.ingestion")
    ensure_topics(pipeline.kafka.config(), [topic], 2)
    columns = {"EMP_ID": "long", "NAME": "string"}
    v1, v2 = qlik.data_schema("EMPLOYEES", columns), qlik.data_schema("EMPLOYEES", {**columns, "AGE": "int"})
    s1, s2 = "a" * 32, "b" * 32
    config = pipeline.kafka.config()
    produce(config, topic, [(b"1", qlik.data_envelope(s1, v1, "INSERT", {"EMP_ID": 1, "NAME": "Ada"})),
                            (b"2", qlik.data_envelope(s1, v1, "REFRESH", {"EMP_ID": 2, "NAME": "Bob"})),
                            (b"meta", qlik.metadata_envelope(s1, "EMPLOYEES", columns, ["EMP_ID"])),
                            (b"1", qlik.data_envelope(s2, v2, "UPDATE", {"EMP_ID": 1, "NAME": "Ada", "AGE": 36}))])
    [run] = pipeline.tick_and_run()
    assert run.success
    now = states(pipeline)
    assert json.loads(now[("hr", "employees", "hr", "2")]["document"]) == {"EMP_ID": 2, "NAME": "Bob"}
    assert json.loads(now[("hr", "employees", "hr", "1")]["document"]) == {"EMP_ID": 1, "NAME": "Ada"}
    [waiting] = pipeline.read("schema_waits").to_pylist()
    assert waiting["code"] == "EA-SCHEMA-PENDING" and s2 in waiting["reason"] and waiting["slice"] == K(1)
    assert waiting["schemaId"] == s2
    # a slice that registers schemas reads the files of waits whose schema ids' range holds one
    [waits] = pipeline.engine.files("schema_waits")
    assert waits_for(waits, {s2, "c" * 32}) and not waits_for(waits, {s1, "c" * 32})
    assert pipeline.read("dead_letters").num_rows == 0 and pipeline.materializations(run)["schema_waits"]["rows"] == 1
    assert [r["schemaId"] for r in pipeline.read("avro_schemas").to_pylist()] == [s1]
    assert pipeline.checks(run)["no_dead_letters"].passed

    # a slice without its schema: the wait (one slice here) is over, the message is a dead letter
    produce(config, topic, [(b"3", qlik.data_envelope(s1, v1, "INSERT", {"EMP_ID": 3, "NAME": "Cy"}))])
    [run] = pipeline.tick_and_run()
    assert run.success and pipeline.materializations(run)["schema_waits"]["rows"] == 0
    [letter] = pipeline.read("dead_letters").to_pylist()
    assert (letter["code"], letter["slice"], letter["kafka_offset"]) == ("EA-SCHEMA-UNKNOWN", K(2), waiting["kafka_offset"])
    assert s2 in letter["reason"] and f"slice {K(1)}" in letter["reason"]
    check = pipeline.checks(run)["no_dead_letters"]
    assert not check.passed and check.metadata["by_stream_and_code"].data == {"ingestion EA-SCHEMA-UNKNOWN": 1}

    produce(config, topic, [(b"meta", qlik.metadata_envelope(s2, "EMPLOYEES", {**columns, "AGE": "int"},
                                                             ["EMP_ID"])),
                            (b"2", qlik.data_envelope(s2, v2, "DELETE", {"EMP_ID": 2, "NAME": "Bob", "AGE": None}))])
    for _ in range(2):  # the slice, then its re-run: the same rows, once
        [run] = pipeline.tick_and_run() or [pipeline.run(K(3))]
        assert run.success
        # slice 1's waiting update; this slice's delete, read after the metadata message in its
        # partition, decodes at once
        assert pipeline.materializations(run)["entity_batches"]["schema_pending_applied"] == 1
        now = states(pipeline)
        assert json.loads(now[("hr", "employees", "hr", "1")]["document"]) == {"EMP_ID": 1, "NAME": "Ada", "AGE": 36}
        assert now[("hr", "employees", "hr", "2")]["deleted"]
        batches = pipeline.read("entity_batches").to_pylist()
        assert sorted((b["slice"], b["kafka_offset"]) for b in batches if b["kafka_partition"] == waiting[
            "kafka_partition"] and b["kafka_offset"] == waiting["kafka_offset"]) == [(K(3), waiting["kafka_offset"])]
        assert len(batches) == 5
        assert pipeline.read("dead_letters").num_rows == 1  # slice 2's record of the wait's end
        assert pipeline.read("schema_waits").num_rows == 1  # slice 1's
        assert pipeline.checks(run)["no_dead_letters"].passed

    # The waiting record's trail: its wait in slice 1, its dead letter, its rows in slice 3, its entity now.
    trail = trace(pipeline.engine, topic, waiting["kafka_partition"], waiting["kafka_offset"])
    assert (trail.slice, trail.applied) == (K(1), K(3))
    assert [r["code"] for r in trail.rows["schema_waits"]] == ["EA-SCHEMA-PENDING"]
    assert [r["code"] for r in trail.rows["dead_letters"]] == ["EA-SCHEMA-UNKNOWN"]
    assert [r["action"] for r in trail.rows["entity_updates"]] == ["updated"]
    assert [s["version"] for s in trail.states["entities"]] == [2]
    assert "applied in slice 0000000003" in format_trail(trail).splitlines()[0]
    # and a metadata message's, to the schema it registered
    [meta] = [r for r in pipeline.read("avro_schemas").to_pylist() if r["schemaId"] == s2]
    trail = trace(pipeline.engine, topic, meta["kafka_partition"], meta["kafka_offset"])
    assert [r["schemaId"] for r in trail.rows["avro_schemas"]] == [s2] and trail.slice == K(3)


def test_a_small_slice_that_applies_waiting_qlik_data_opens_no_spark_session(make_pipeline, monkeypatch):
    """A slice of a few records runs in the run's process: a run image without Java, or the JVM's
    start, must not meet the first slice that registers a schema others wait for."""
    from resources import SparkResource

    pipeline = make_pipeline(production_layout=True, schema_wait_slices=2)

    def no_session(self):
        raise AssertionError("a small slice asked for a Spark session")

    monkeypatch.setattr(SparkResource, "session", no_session)
    topic = pipeline.topic("hr.employees.ingestion")
    ensure_topics(pipeline.kafka.config(), [topic], 2)
    columns = {"EMP_ID": "long", "NAME": "string"}
    schema = qlik.data_schema("EMPLOYEES", columns)
    config = pipeline.kafka.config()
    produce(config, topic, [(b"1", qlik.data_envelope("a" * 32, schema, "INSERT", {"EMP_ID": 1, "NAME": "Ada"}))])
    [run] = pipeline.tick_and_run()
    assert run.success and pipeline.read("schema_waits").num_rows == 1
    produce(config, topic, [(b"meta", qlik.metadata_envelope("a" * 32, "EMPLOYEES", columns, ["EMP_ID"]))])
    [run] = pipeline.tick_and_run()
    assert run.success and pipeline.materializations(run)["entity_batches"]["schema_pending_applied"] == 1
    assert json.loads(states(pipeline)[("hr", "employees", "hr", "1")]["document"]) == {"EMP_ID": 1, "NAME": "Ada"}


def test_without_a_wait_an_unknown_schema_is_a_dead_letter_at_once(make_pipeline):
    """`schema_wait_slices=0`: the slice that read the data message dead-letters it, and still keeps its wait."""
    pipeline = make_pipeline(schema_wait_slices=0)
    topic = pipeline.topic("hr.employees.ingestion")
    ensure_topics(pipeline.kafka.config(), [topic], 1)
    columns = {"EMP_ID": "long"}
    produce(pipeline.kafka.config(), topic, [
        (b"1", qlik.data_envelope("c" * 32, qlik.data_schema("EMPLOYEES", columns), "INSERT", {"EMP_ID": 1}))])
    [run] = pipeline.tick_and_run()
    assert run.success
    assert [(r["code"], r["slice"]) for r in pipeline.read("dead_letters").to_pylist()] == [("EA-SCHEMA-UNKNOWN", K(1))]
    assert [(r["code"], r["slice"]) for r in pipeline.read("schema_waits").to_pylist()] == [("EA-SCHEMA-PENDING", K(1))]


@pytest.mark.parametrize(("history", "ended"), [
    ([(1, 4)], {5: [1], 6: [2], 13: [9]}),
    ([(1, 0)], {1: [1], 2: [2]}),
    ([(1, 4), (10, 1)], {9: [5], 10: [6, 7, 8, 9], 11: [10]}),
    ([(1, 1), (10, 4)], {9: [8], 10: [], 12: [], 13: [9], 14: [10]}),
])
def test_the_waits_a_slice_ends_leave_none_out_and_none_twice_when_the_wait_changes(history, ended):
    from entity_assets.ingest import waits_ending

    each = {n: [int(k) for k in waits_ending(K(n), history)] for n in range(1, 20)}
    assert {n: each[n] for n in ended} == ended
    assert sorted(k for keys in each.values() for k in keys) == list(range(1, 1 + len(sum(each.values(), []))))


def test_a_changed_schema_wait_ends_each_slice_s_waits_once_and_re_runs_keep_their_first_run_s(make_pipeline):
    """Lowered from 3 to 1 at slice 3, the wait ends both slices' before it at once (slice 3 - 1's
    alone would leave slice 1's waiting for good), slice 4 ends none of them again, and a re-run of
    slice 3 under the old setting writes the same dead letters."""
    patient = make_pipeline(schema_wait_slices=3)
    topic = patient.topic("hr.employees.ingestion")
    ensure_topics(patient.kafka.config(), [topic], 1)
    schema = qlik.data_schema("EMPLOYEES", {"EMP_ID": "long"})
    for emp in (1, 2):  # slices 1 and 2: a data message whose schema never comes
        produce(patient.kafka.config(), topic, [(b"%d" % emp, qlik.data_envelope("f" * 32, schema, "INSERT",
                                                                                  {"EMP_ID": emp}))])
        [run] = patient.tick_and_run()
        assert run.success
    hasty = make_pipeline(prefix=patient.prefix, lake_root=patient.lake.root, instance=patient.instance,
                          schema_wait_slices=1)

    def letters():
        return sorted((r["slice"], r["kafka_offset"]) for r in hasty.read("dead_letters").to_pylist()
                      if r["code"] == "EA-SCHEMA-UNKNOWN")

    for n in (3, 4):
        hasty.produce(samples.BatchTraffic(patches=1, entities=1, seed=n).records())
        [run] = hasty.tick_and_run()
        assert run.success
        assert letters() == [(K(3), 0), (K(3), 1)]
    assert patient.run(K(3)).success  # the setting of its first run, 1, not 3 (which would end none)
    assert letters() == [(K(3), 0), (K(3), 1)]
    assert any(f"in the 2 slice(s) from slice {K(1)}" in r["reason"] for r in hasty.read("dead_letters").to_pylist())


def test_slices_that_read_qlik_schemas_are_ingested_in_order(make_pipeline):
    """A slice decodes with the schemas of the slices before it, and ends the waits of the slice
    `schema_wait_slices` before it unless a slice since registered their schema: either way it
    refuses to be ingested before the slice before it, or before the slice whose waits it ends,
    and names the one missing."""
    pipeline = make_pipeline(schema_wait_slices=2)
    topic = pipeline.topic("hr.employees.ingestion")
    ensure_topics(pipeline.kafka.config(), [topic], 1)
    columns, sid = {"EMP_ID": "long"}, "e" * 32
    produce(pipeline.kafka.config(), topic, [
        (b"1", qlik.data_envelope(sid, qlik.data_schema("EMPLOYEES", columns), "INSERT", {"EMP_ID": 1}))])
    [first] = pipeline.tick()
    produce(pipeline.kafka.config(), topic, [(b"meta", qlik.metadata_envelope(sid, "EMPLOYEES", columns, ["EMP_ID"]))])
    [second] = pipeline.tick()
    pipeline.produce(samples.BatchTraffic(patches=3, entities=3).records())
    [third] = pipeline.tick()
    ingest = pipeline.asset_keys_of("dead_letters")

    def refused(request, missing: str) -> None:
        result = pipeline.run(request.partition_key, assets=ingest, raise_on_error=False)
        [failure] = [e for e in result.all_events if e.is_step_failure]
        assert not result.success and f"slice {missing} is not ingested" in pipeline.failure_text(failure)

    refused(second, K(1))  # its data messages would be decoded without slice 1's schemas
    refused(third, K(1))  # slice 1's waits, ingested after it, would never end
    assert pipeline.run(first.partition_key, assets=ingest).success
    assert pipeline.read("schema_waits").num_rows == 1
    refused(third, K(2))  # it ends slice 1's wait, unless slice 2 registered the schema: it did
    assert pipeline.run(second.partition_key, assets=ingest).success
    assert pipeline.run(third.partition_key, assets=ingest).success
    assert pipeline.read("dead_letters").num_rows == 0
    assert [r["slice"] for r in pipeline.read("entity_batches").to_pylist()
            if r["kafka_topic"] == topic] == [K(2)]


@pytest.mark.parametrize("schema_projection", [None, "schemas"])
def test_a_schema_topic_and_topics_of_several_tables(make_pipeline, schema_projection):
    """Replicate can write its metadata messages to a schema topic of their own and every table's
    data to one topic; a Debezium router can do the same. With `collection="table"` each record's
    table is its collection; a schema serves every topic, whichever topic registered it. Named as
    the source's `schema_projection`, the schema topic is read first: the data messages of the
    slice that registers their schemas decode at once instead of waiting for the tasks' end."""
    pipeline = make_pipeline(ingestion={"hr": IngestionSource(format="qlik", collection="table",
                                                              schema_projection=schema_projection),
                                        "shop": IngestionSource(format="debezium", collection="table")})
    schemas, hr, shop = (pipeline.topic(t) for t in ("hr.schemas.ingestion", "hr.all.ingestion",
                                                      "shop.all.ingestion"))
    ensure_topics(pipeline.kafka.config(), [schemas, hr, shop], 2)
    config = pipeline.kafka.config()
    emp, dept = {"EMP_ID": "long", "NAME": "string"}, {"DEPT_ID": "string"}
    se, sd = "e" * 32, "d" * 32
    produce(config, hr, [(None, qlik.data_envelope(se, qlik.data_schema("EMPLOYEES", emp), "INSERT",
                                                   {"EMP_ID": 1, "NAME": "Ada"})),
                         (None, qlik.data_envelope(sd, qlik.data_schema("DEPTS", dept), "INSERT", {"DEPT_ID": "rd"}))])
    produce(config, schemas, [(b"EMPLOYEES", qlik.metadata_envelope(se, "EMPLOYEES", emp, ["EMP_ID"])),
                              (b"DEPTS", qlik.metadata_envelope(sd, "DEPTS", dept, ["DEPT_ID"]))])
    produce(config, shop, [(enc({"ID": 1}), enc({"op": "c", "after": {"ID": 1}, "source": {"table": "orders"}})),
                           (enc({"ID": 1}), enc({"op": "c", "after": {"ID": 1}, "source": {"table": "carts"}})),
                           (enc({"ID": 1}), enc({"op": "d", "before": {"ID": 1}, "source": {"table": "carts"}})),
                           (enc({"ID": 1}), None)])  # a tombstone names no table: the projection's, status 2
    [run] = pipeline.tick_and_run()
    assert run.success and pipeline.read("dead_letters").num_rows == 0
    assert pipeline.materializations(run)["entity_batches"]["schema_pending_applied"] == (0 if schema_projection else 2)
    produce(config, hr, [(None, qlik.data_envelope(sd, qlik.data_schema("DEPTS", dept), "DELETE", {"DEPT_ID": "rd"}))])
    produce(config, schemas, [(b"bad", b"atMSG, then no envelope")])  # read first, then a dead letter of its task
    [run] = pipeline.tick_and_run()  # decoded by the tasks: registered by the schema topic in slice 1
    assert run.success and pipeline.materializations(run)["entity_batches"]["schema_pending_applied"] == 0
    [bad] = pipeline.read("dead_letters").to_pylist()
    assert (bad["kafka_topic"], bad["code"]) == (schemas, "GENERR001")
    assert {k[1:]: v["deleted"] for k, v in states(pipeline).items()} == {
        ("EMPLOYEES", "hr", "1"): False, ("DEPTS", "hr", "rd"): True,
        ("orders", "shop", "1"): False, ("carts", "shop", "1"): True}
    statuses = sorted((r["kafka_topic"], r["status"]) for r in pipeline.read("partial_responses").to_pylist())
    assert statuses == sorted([(hr, 1)] * 3 + [(shop, 1)] * 3 + [(shop, 2)])


def test_the_sample_cdc_traffic_of_every_format(make_pipeline):
    """`entity-assets produce cdc`: four sources, one per format, each table's rows inserted,
    changed twice, every tenth deleted; Qlik's metadata message read after its first data."""
    pipeline = make_pipeline()
    ensure_topics(pipeline.kafka.config(), [pipeline.topic(s) for s in samples.CDC_STREAMS], 2)
    produced = pipeline.produce(samples.CdcTraffic(rows=20).records())
    assert set(produced) == set(samples.CDC_STREAMS)
    [run] = pipeline.tick_and_run()
    assert run.success
    assert pipeline.read("dead_letters").num_rows == 0
    # no schema was known: the Qlik data messages read before the slice's metadata message waited
    # for it; those after it in its partition decoded at once
    [md] = pipeline.read("avro_schemas").to_pylist()
    qlik_rows = [(b["kafka_partition"], b["kafka_offset"]) for b in pipeline.read("entity_batches").to_pylist()
                 if b["kafka_topic"] == md["kafka_topic"]]
    after = [o for p, o in qlik_rows if p == md["kafka_partition"] and o > md["kafka_offset"]]
    assert len(qlik_rows) == 20 * 3 + 2 and after
    assert pipeline.materializations(run)["entity_batches"]["schema_pending_applied"] == len(qlik_rows) - len(after)
    by_collection: dict[str, list] = {}
    for row in states(pipeline).values():
        by_collection.setdefault(row["collection"], []).append(row)
    assert sorted(by_collection) == ["accounts", "customers", "employees", "users"]
    for rows in by_collection.values():
        assert len(rows) == 20 and sum(r["deleted"] for r in rows) == 2
        assert {r["version"] for r in rows if not r["deleted"]} == {3}
    updates = pipeline.read("entity_updates").num_rows
    assert updates == 4 * (20 * 3 + 2)


def test_debezium_mongodb_documents_become_plain_entities(make_pipeline):
    """Debezium's MongoDB connector (format `auto`): the documents and the key's `_id` are Extended
    JSON text. An update without its document (a capture mode other than the full document's)
    is a dead letter, so a lost change is seen."""
    pipeline = make_pipeline()
    topic = pipeline.topic("catalog.products.ingestion")
    ensure_topics(pipeline.kafka.config(), [topic], 1)
    oid = "65bc9fb6c485f419a7a877fe"
    key = enc({"id": enc({"$oid": oid}).decode()})

    def value(op, after=None):
        return enc({"op": op, "after": after and enc(after).decode(),
                    "source": {"connector": "mongodb", "db": "shop", "collection": "products"}})

    produce(pipeline.kafka.config(), topic, [
        (key, value("c", {"_id": {"$oid": oid}, "qty": {"$numberLong": "1"}, "at": {"$date": 0}})),
        (key, value("u", {"_id": {"$oid": oid}, "qty": 2, "at": {"$date": "1970-01-01T00:00:00Z"}})),
        (key, value("u")),  # capture.mode=change_streams: the changed fields only
        (enc({"id": "7"}), value("r", {"_id": 7, "name": "snapshot"})),
        (enc({"id": "7"}), value("d")),
        (enc({"id": "7"}), None)])  # the tombstone: gone already, status 2
    [run] = pipeline.tick_and_run()
    assert run.success
    [dead] = pipeline.read("dead_letters").to_pylist()
    assert dead["code"] == "GENERR001" and "a MongoDB update without its document" in dead["reason"]
    now = states(pipeline)
    product = now[("catalog", "products", "catalog", oid)]
    assert json.loads(product["document"]) == {"_id": oid, "qty": 2, "at": "1970-01-01T00:00:00.000Z"}
    assert product["version"] == 2 and now[("catalog", "products", "catalog", "7")]["deleted"]
    assert sorted(r["status"] for r in pipeline.read("partial_responses").to_pylist()) == [1, 1, 1, 1, 2]
