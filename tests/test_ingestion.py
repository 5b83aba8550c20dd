"""CDC ingestion topics through the real broker, Spark and Delta: records of the three formats
become entity batches and take the native path to updates, state and responses; bad ones
reach dead letters."""

import json

from entity_assets import adapters
from entity_assets.kafka_io import ensure_topics, produce
from entity_assets.trace import trace
from resources.kafka import IngestionSource

ROW = {"USER_ID": 1, "NAME": "Mario"}


def enc(value) -> bytes:
    return json.dumps(value).encode()


def states(pipeline) -> dict[tuple, dict]:
    return {(r["dbid"], r["collection"], r["zone"], r["entity"]): r for r in pipeline.read("entities").to_pylist()}


def test_cdc_records_become_entities_and_bad_ones_dead_letters(make_pipeline):
    pipeline = make_pipeline(ingestion={"crm": IngestionSource(format="debezium", dbid="my-db", zone="A"),
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
                          (b"A1_7", enc({"op_type": "U", "before": {"ID": "A1"}, "after": {"ID": "A1", "N": 8},
                                         "pos": 2}))])
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


def test_without_sources_no_ingestion_topic_is_read(make_pipeline):
    pipeline = make_pipeline(ingestion={})
    topic = pipeline.topic("crm.customers.ingestion")
    ensure_topics(pipeline.kafka.config(), [topic], 1)
    produce(pipeline.kafka.config(), topic, [(b"1", enc({"ID": 1}))])
    assert pipeline.tick() == []
    assert pipeline.kafka.input_stream(topic) is None
