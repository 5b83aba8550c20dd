"""The whole graph end to end: a real broker, real Spark, real Delta tables, Dagster through its public API.

Kafka input records -> sensor tick -> `slice_job` run (every asset of the code location) -> the
derived tables and the messages published on their topics: schema updates and schema learning,
learned schemas and their check, devices, zone changes, changes by device and device
notifications, dead letters. Slice runs are expensive (whole graph, seconds each), so each
test drives a few slices and checks everything those slices should have produced.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.compute as pc
import pytest
from dagster import AssetCheckSeverity

from entity_assets import messages, notify, publish, samples, storage, trace
from entity_assets.assets import common
from entity_assets.maintenance import lake_maintenance
from entity_assets.publish import partition_for
from entity_assets.slices import slice_key
from entity_assets.storage import TableFile, read_tables
from resources import LakeResource, SparkResource

K1, K2, K3, K4 = slice_key(1), slice_key(2), slice_key(3), slice_key(4)
CLIENT = samples.SEED_CLIENT
DB = "my-db"


# --------------------------------------------------------------------------- helpers

def rows(pipeline, table: str, key: str | None = None) -> list[dict]:
    """A lake table's current rows, those of one slice when `key` is given."""
    t = pipeline.read(table)
    if key is not None:
        t = t.filter(pc.equal(t["slice"], key))
    return t.to_pylist()


def messages_on(pipeline, stream: str) -> list[dict]:
    """Every message of a derived stream: {partition, key (str), value (JSON), timestamp}."""
    return [{**r, "key": r["key"].decode() if r["key"] is not None else None, "value": json.loads(r["value"])}
            for r in pipeline.consume(stream)]


def partitions_of(pipeline, stream: str) -> int:
    return len(pipeline.end_offsets(stream))


def test_every_message_published_is_a_message_of_its_streams_model(pipeline):
    """What the Arrow encoders publish (`encode`, `publish.STREAMS`) validates against the pydantic
    model of its stream (`messages.TOPIC_MODELS`, the seed's fields and types), on every topic."""
    traffic = samples.GraphTraffic(samples.BatchTraffic(patches=200, entities=40, learning=True), devices=10)
    missing = {"db": DB, "clientid": CLIENT, "request": 90, "user": "jsmith", "begun": 1415747081000, "patches": [
        {"collection": "Contacts", "zone": "A", "entity": "nobody", "ops": [{"op": "replace", "path": "x", "value": 1}]}]}
    run_slice(pipeline, [*traffic.records(), ("schema-patches", DB, samples.encode(DECLARE)),
                         ("schema-patches", DB, samples.encode(FAILING)),
                         ("entity-batches", samples.request_key(CLIENT, 90), samples.encode(missing))], K1)
    assert any(m["value"]["status"] == 2 for m in messages_on(pipeline, "partial-responses"))  # a response, no update
    for stream in publish.STREAMS.values():
        published = messages_on(pipeline, stream.name)
        assert published, stream.name
        for m in published:
            model = messages.TOPIC_MODELS.get(stream.name) or (
                messages.SchemaLearningEntityType if m["key"] == m["value"]["dbid"] and "entity" not in m["value"]
                else messages.EntityUpdate)
            parsed = messages.parse_message(model, json.dumps(m["value"]))
            assert isinstance(parsed, model) and getattr(parsed, "dbid", None) == m["value"].get("dbid"), m
            if model is messages.EntityUpdate:  # the seed: "only ... successfully applied" patches, status 1
                assert parsed.status == 1 and parsed.error is None, m


def run_slice(pipeline, records, expected_key: str):
    """Produces `records`, ticks once (one slice closes) and runs it through the whole graph."""
    pipeline.produce(records)
    [request] = pipeline.tick()
    assert request.partition_key == expected_key
    result = pipeline.run_request(request)
    assert result.success
    return result


# --------------------------------------------------------------------------- the seed's schema samples

def field(type_: str, optional: bool) -> dict:
    return {"type": type_, "optional": optional}


# The seed's schema-updates sample: before and after, as the seed writes them.
SEED_SCHEMA_BEFORE = {
    "Contacts": {"fields": {"firstName": field("STRING", False), "lastName": field("STRING", False)}},
    "Groups": {"fields": {"groupName": field("STRING", False)}},
}
SEED_SCHEMA_AFTER = {
    "Contacts": {"fields": {"firstName": field("STRING", False), "lastName": field("STRING", False),
                            "homePhone": field("STRING", True)}},
    "Groups": {"fields": {"groupName": field("STRING", False)}},
}
# The seed's schema-learning sample's after: the Contacts entity type only, with homePhone.
SEED_LEARNING_AFTER = {"Contacts": SEED_SCHEMA_AFTER["Contacts"]}

DECLARE = {  # declares the schema the seed's sample starts from
    "db": DB, "clientid": CLIENT, "request": 1, "user": "jsmith", "begun": 1415747080000, "part": 1, "parts": 1,
    "includeAfter": True,
    "ops": [{"op": "add", "path": "Contacts", "value": SEED_SCHEMA_BEFORE["Contacts"]},
            {"op": "add", "path": "Groups", "value": SEED_SCHEMA_BEFORE["Groups"]}],
}
FAILING = {  # a schema patch that cannot apply (nothing at its path): status 3, on schema-updates too
    **DECLARE, "request": 5, "begun": 1415747081000, "ops": [{"op": "remove", "path": "Orders/fields/total"}]}
HOME_PHONE = {  # the seed's schema-updates sample's request, as the seed writes it
    "db": DB, "clientid": CLIENT, "request": 2, "user": "jsmith", "begun": 1415747089227, "part": 1, "parts": 1,
    "includeBefore": True, "includeAfter": True,
    "ops": [{"op": "add", "path": "Contacts/fields/homePhone", "value": field("STRING", True)}],
}

SALLY, WILLIAM = "400cb092-00af-4e44-bdcb-1a0c536692bf", "101c3c90-e304-4279-b6a0-020363c925c6"
GROUP = "6f1f1a52-3f0b-4c1e-9d6b-3d5a0c1f2e77"
SALLY_DOC = {"firstName": "Sally", "lastName": "Anderson", "phone": {"home": "1-222-555-1234"}}
WILLIAM_DOC = {"firstName": "William", "lastName": "Johnson", "homePhone": "1-222-555-9876"}
LEARNING_BATCH = {  # the seed's two Contacts of its complete-responses sample, plus a group; request 3
    "db": DB, "clientid": CLIENT, "request": 3, "user": "jsmith", "begun": 1415747090000,
    "includeBefore": True, "includeAfter": True, "learning": True,
    "patches": [
        samples.SEED_ENTITY_BATCH["patches"][0],
        {"collection": "Contacts", "zone": "default", "entity": WILLIAM,
         "ops": [{"op": "add", "path": k, "value": v} for k, v in WILLIAM_DOC.items()]},
        {"collection": "Groups", "zone": "default", "entity": GROUP,
         "ops": [{"op": "add", "path": "groupName", "value": "Friends"}]},
    ],
}
LEARNED_CONTACTS = {"fields": {
    "firstName": field("STRING", False),
    "homePhone": field("STRING", True),
    "lastName": field("STRING", False),
    # only Sally has a phone document: learned, optional, with its nested field
    "phone": {"type": "DOCUMENT", "optional": True, "fields": {"home": field("STRING", False)}},
}}

DEVICE = samples.SEED_CONNECTION["device"]
DEVICE2, DEVICE3 = "5d2c1b0a-1111-4222-8333-944455556666", "0e9d8c7b-aaaa-4bbb-8ccc-dddd0000eeee"


def connection(user: str, device: str, app_version: str, begun: int) -> tuple[str, str, bytes]:
    return ("connections", user, samples.encode({"db": DB, "clientid": CLIENT, "user": user, "device": device,
                                                 "appVersion": app_version, "begun": begun}))


# Bad records of three input streams: (stream, key, value, code, a word the reason names)
BAD = [
    ("schema-patches", DB, b'{"db": "my-db", "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd", "ops": [',
     "GENERR007", "JSON"),
    ("connections", "jsmith", samples.encode({k: v for k, v in samples.SEED_CONNECTION.items() if k != "device"}),
     "GENERR001", "device"),
    ("notification-acks", DEVICE, samples.encode({"db": DB, "user": "jsmith", "device": DEVICE, "begun": 1415747100000}),
     "GENERR001", "notifications"),
    # a part count the seed's `int` cannot hold: it once passed validation and failed the slice's ingest
    ("schema-patches", DB, samples.encode({**samples.SEED_SCHEMA_PATCH, "parts": 2**31}), "GENERR001", "parts"),
    ("schema-patches", DB, samples.encode({**samples.SEED_SCHEMA_PATCH, "parts": 2, "part": 3}), "GENERR001",
     "part 3 of a request of 2 parts"),
]


@pytest.mark.parametrize("driver_rows", [0, 10_000], ids=["spark-tasks", "small-work-in-the-driver"])
def test_schema_updates_learning_devices_and_dead_letters(make_pipeline, driver_rows):
    pipeline = make_pipeline(driver_rows=driver_rows)
    # ---- slice 1: the declared schema, a first connection, a valid ack, and bad records in between
    good_ack = ("notification-acks", DEVICE, samples.encode({"db": DB, "user": "jsmith", "device": DEVICE,
                                                             "upTo": 1415747100000, "begun": 1415747100000}))
    bad = [(s, k, v) for s, k, v, _, _ in BAD]
    r1 = run_slice(pipeline, [bad[0], ("schema-patches", DB, samples.encode(DECLARE)), bad[1],
                              ("schema-patches", DB, samples.encode(FAILING)),
                              connection("jsmith", DEVICE, "1.0", 1415747000000), bad[2], good_ack, *bad[3:]], K1)

    # 9. bad records become dead letters with their codes and streams; the rest of the slice goes on
    dead = rows(pipeline, "dead_letters")
    assert sorted((d["stream"], d["code"]) for d in dead) == sorted((s, c) for s, _, _, c, _ in BAD)
    expected = {v: (s, k, word) for s, k, v, _, word in BAD}
    for d in dead:
        stream, key, word = expected[d["value"]]
        assert d["stream"] == stream and d["kafka_key"] == key.encode()
        assert d["kafka_topic"] == pipeline.topic(d["stream"]) and d["slice"] == K1
        assert word in d["reason"], d["reason"]
    # every schema patch processed is a schema update, a failed one with its status and error (the
    # seed: "a durable record of all schema patch requests"); only the applied one learns
    assert sorted((r["request"], r["status"], r["error"] is None) for r in rows(pipeline, "schema_updates", K1)) == [
        (1, 1, True), (5, 3, False)]
    assert {r["request"] for r in rows(pipeline, "schema_learning", K1)} == {1}
    assert json.loads(rows(pipeline, "schemas")[0]["document"]) == SEED_SCHEMA_BEFORE
    assert [(r["device"], r["upTo"]) for r in rows(pipeline, "notification_acks")] == [(DEVICE, 1415747100000)]
    meta1 = pipeline.materializations(r1)
    assert meta1["dead_letters"]["rows"] == len(BAD)
    # each input table's own records' dead letters, and the UI's row counts of the slice
    assert {t: meta1[t]["dead_letters"] for t in ("entity_batches", "schema_patches", "connections",
                                                  "notification_acks")} == {
        "entity_batches": 0, "schema_patches": 3, "connections": 1, "notification_acks": 1}
    assert meta1["dead_letters"]["dagster/partition_row_count"] == len(BAD) and "dead_letters" not in meta1["avro_schemas"]
    assert meta1["devices"]["app_versions"] == {"1.0": 1}

    # ---- slice 2: the seed's homePhone patch, learning entities, more connections
    r2 = run_slice(pipeline, [
        ("schema-patches", DB, samples.encode(HOME_PHONE)),
        ("entity-batches", samples.request_key(CLIENT, 3), samples.encode(LEARNING_BATCH)),
        ("connections", "jsmith", samples.encode(samples.SEED_CONNECTION)),  # appVersion 1.1, 1415747103842
        connection("jsmith", DEVICE, "0.9", 1415746000000),  # arrives later, happened earlier
        connection("jsmith", DEVICE2, "1.1", 1415747104000),
        connection("alee", DEVICE3, "2.0", 1415747105000),
    ], K2)

    # 1. the seed's schema-updates sample, exactly
    [update] = rows(pipeline, "schema_updates", K2)
    assert (update["request"], update["status"]) == (2, 1)
    assert json.loads(update["before"]) == SEED_SCHEMA_BEFORE
    assert json.loads(update["after"]) == SEED_SCHEMA_AFTER
    [schema] = rows(pipeline, "schemas")
    assert (schema["dbid"], schema["version"], schema["deleted"]) == (DB, 2, False)
    assert json.loads(schema["document"]) == SEED_SCHEMA_AFTER
    # the schema patch's trail (entity-assets trace) ends at its database's schema as it is now
    trail = trace.trace(pipeline.engine, update["kafka_topic"], update["kafka_partition"], update["kafka_offset"])
    assert trail.states == {"schemas": [{k: v for k, v in schema.items() if k != "bucket"}]}
    assert f"schemas               now: dbid={DB} version=2 slice={K2} document=" in trace.format_trail(trail)
    # a learning batch's trail ends at each entity it patched
    [learned] = rows(pipeline, "entity_batches", K2)
    trail = trace.trace(pipeline.engine, learned["kafka_topic"], learned["kafka_partition"], learned["kafka_offset"])
    assert {r["entity"]: (r["version"], r["slice"], json.loads(r["document"])) for r in trail.states["entities"]} == {
        SALLY: (1, K2, SALLY_DOC), WILLIAM: (1, K2, WILLIAM_DOC), GROUP: (1, K2, {"groupName": "Friends"})}
    by_request = {m["value"]["request"]: m for m in messages_on(pipeline, "schema-updates")}
    assert sorted(by_request) == [1, 2, 5]
    assert by_request[5]["value"]["status"] == 3 and "Orders" in by_request[5]["value"]["error"]
    message = by_request[2]
    assert message["key"] == DB
    assert message["partition"] == partition_for(DB, partitions_of(pipeline, "schema-updates"))
    value = message["value"]
    assert value["before"] == SEED_SCHEMA_BEFORE and value["after"] == SEED_SCHEMA_AFTER
    assert {k: value[k] for k in HOME_PHONE} == HOME_PHONE  # every field of the request, as sent
    assert value["status"] == 1 and value["dbid"] == DB and "error" not in value
    assert value["ended"] == update["ended"] == max(update["kafka_timestamp"], HOME_PHONE["begun"])

    # 2. schema_learning: one entity-type row per type of the updated schema, and the learning entities
    learning = rows(pipeline, "schema_learning", K2)
    types = sorted((r for r in learning if r["kind"] == "entity-type"), key=lambda r: r["part"])
    assert [(r["collection"], r["part"], r["parts"]) for r in types] == [("Contacts", 1, 2), ("Groups", 2, 2)]
    assert all(r["request"] == 2 and r["status"] == 1 and r["ops"] is None and r["entity"] is None for r in types)
    assert json.loads(types[0]["after"]) == SEED_LEARNING_AFTER
    assert json.loads(types[1]["after"]) == {"Groups": SEED_SCHEMA_AFTER["Groups"]}
    entities = {r["entity"]: r for r in learning if r["kind"] == "entity"}
    assert {e: (r["collection"], r["request"], r["part"], r["parts"]) for e, r in entities.items()} == {
        SALLY: ("Contacts", 3, 1, 3), WILLIAM: ("Contacts", 3, 2, 3), GROUP: ("Groups", 3, 3, 3)}
    assert json.loads(entities[SALLY]["after"]) == SALLY_DOC
    assert json.loads(entities[WILLIAM]["after"]) == WILLIAM_DOC
    assert json.loads(entities[GROUP]["after"]) == {"groupName": "Friends"}
    assert [r["kind"] for r in rows(pipeline, "schema_learning", K1)] == ["entity-type"] * 2  # the declaration's

    published = messages_on(pipeline, "schema-learning")
    n = partitions_of(pipeline, "schema-learning")
    assert len(published) == 2 + 2 + 3  # slice 1's types, slice 2's types and entities
    for m in published:  # partitioned by collection (an entity type's is the one its after holds), whatever the key
        [collection] = m["value"]["after"] if m["key"] == DB else [m["value"]["collection"]]
        assert m["partition"] == partition_for(collection, n), m
    # an entity type's message has the schema update's header fields only, as the seed's sample
    assert not [m for m in published if m["key"] == DB and "collection" in m["value"]]
    type_messages = {(m["value"]["request"], *m["value"]["after"]): m for m in published if m["key"] == DB}
    assert sorted(type_messages) == [(1, "Contacts"), (1, "Groups"), (2, "Contacts"), (2, "Groups")]
    contacts = type_messages[(2, "Contacts")]["value"]
    assert contacts["after"] == SEED_LEARNING_AFTER
    assert {k: contacts[k] for k in ("db", "clientid", "request", "user", "part", "status")} == {
        "db": DB, "clientid": CLIENT, "request": 2, "user": "jsmith", "part": 1, "status": 1}
    assert contacts["parts"] == 2 and contacts["begun"] == HOME_PHONE["begun"] and "ops" not in contacts
    updates = {m["key"]: m["value"] for m in messages_on(pipeline, "entity-updates")}
    entity_messages = {m["key"]: m["value"] for m in published if m["key"] != DB}
    assert set(entity_messages) == {SALLY, WILLIAM, GROUP}
    for entity, value in entity_messages.items():
        # the entity-updates message of that entity, with its document
        assert value["after"] == json.loads(entities[entity]["after"])
        assert {k: v for k, v in value.items() if k != "before"} == {
            k: v for k, v in updates[entity].items() if k != "before"}

    # 3. learned_schemas: the undeclared phone document is learned and reported
    learned = {(r["dbid"], r["collection"]): r for r in rows(pipeline, "learned_schemas")}
    assert set(learned) == {(DB, "Contacts"), (DB, "Groups")}
    row = learned[(DB, "Contacts")]
    assert row["observed"] == 2
    assert json.loads(row["declared"]) == SEED_SCHEMA_AFTER["Contacts"]
    assert json.loads(row["learned"]) == LEARNED_CONTACTS
    assert [(d["path"], d["kind"]) for d in json.loads(row["disagreements"])] == [("phone", "undeclared")]
    groups = learned[(DB, "Groups")]
    assert groups["observed"] == 1 and json.loads(groups["disagreements"]) == []
    assert json.loads(groups["learned"]) == SEED_SCHEMA_AFTER["Groups"]
    checks2 = pipeline.checks(r2)
    check = checks2["entities_match_declared_schema"]
    assert check.passed is False and check.severity == AssetCheckSeverity.WARN  # what clients sent, learned anyway
    assert check.metadata["collections_disagreeing"].value == 1 and check.metadata["disagreement_count"].value == 1
    report = check.metadata["disagreements"].value
    assert set(report) == {f"{DB}/Contacts"}  # Groups' entities match its declaration
    assert [(d["path"], d["kind"]) for d in report[f"{DB}/Contacts"]] == [("phone", "undeclared")]
    assert pipeline.checks(r1)["entities_match_declared_schema"].passed is True  # nothing learned yet
    assert all(e.passed for name, e in checks2.items() if name != "entities_match_declared_schema")
    # every bucketed state is checked for repeated keys
    assert {"one_row_per_entity", "one_row_per_database", "one_row_per_device", "one_inbox_per_device"} <= set(checks2)

    # 4. devices: per user the devices seen, first and last seen, the latest app version
    devices = {(r["dbid"], r["user"], r["device"]): r for r in rows(pipeline, "devices")}
    assert {k: (r["firstSeen"], r["lastSeen"], r["appVersion"], r["connections"], r["clientid"], r["slice"])
            for k, r in devices.items()} == {
        (DB, "jsmith", DEVICE): (1415746000000, 1415747103842, "1.1", 3, CLIENT, K2),
        (DB, "jsmith", DEVICE2): (1415747104000, 1415747104000, "1.1", 1, CLIENT, K2),
        (DB, "alee", DEVICE3): (1415747105000, 1415747105000, "2.0", 1, CLIENT, K2),
    }
    # a connection's trail (entity-assets trace) ends at its device's state
    [late] = [r for r in rows(pipeline, "connections", K2) if r["appVersion"] == "0.9"]
    trail = trace.trace(pipeline.engine, late["kafka_topic"], late["kafka_partition"], late["kafka_offset"])
    assert [r["appVersion"] for r in trail.rows["connections"]] == ["0.9"] and list(trail.rows) == ["connections"]
    state = devices[(DB, "jsmith", DEVICE)]
    assert trail.states == {"devices": [{k: v for k, v in state.items() if k != "bucket"}]}
    assert f"devices               now: user=jsmith device={DEVICE} appVersion=1.1 firstSeen=1415746000000" \
           in trace.format_trail(trail)
    meta2 = pipeline.materializations(r2)
    assert meta2["devices"]["app_versions"] == {"1.1": 2, "2.0": 1}
    assert meta2["devices"]["connections_this_slice"] == 4
    assert meta2["dead_letters"]["rows"] == 0 and rows(pipeline, "dead_letters", K2) == []

    # ---- slice 3: no connections; the devices state stays as it is and records the slice
    r3 = run_slice(pipeline, [("notification-acks", DEVICE, samples.encode(
        {"db": DB, "user": "jsmith", "device": DEVICE, "begun": 1415747200000, "upTo": 1415747200000}))], K3)
    meta3 = pipeline.materializations(r3)
    assert meta3["devices"]["app_versions"] == {"1.1": 2, "2.0": 1}
    assert meta3["devices"]["connections_this_slice"] == 0 and meta3["devices"]["replayed"] is False
    assert {(r["dbid"], r["user"], r["device"]): r for r in rows(pipeline, "devices")} == devices
    assert pipeline.engine.applied("devices", common.STATE_APP) == 3

    # a replay of slice 2 reports the counts of the state slice 2 made: the counts recorded on
    # slice 1's commit plus slice 2's changes, folded again over the state as of slice 1
    again = pipeline.materializations(pipeline.run(K2))["devices"]
    assert again["replayed"] is True and again["app_versions"] == {"1.1": 2, "2.0": 1}


# --------------------------------------------------------------------------- zones, devices, notifications

FUTURE = 4_000_000_000_000
"""`begun` past any Kafka timestamp, so `ended` (max of the two) is exactly `begun`."""

ADMIN = "0f3e2d1c-0b0a-4999-8888-777766665555"
ZONE_SUBSCRIBERS = {  # device -> (user, subjectZone, actions)
    "device1": ("alice", "A", ["created", "deleted"]),
    "device2": ("bob", "A", ["created", "updated", "deleted"]),
    "device3": ("carol", "B", ["created", "updated", "deleted"]),
}
ENTITY_A, ENTITY_B = "a-contact-1", "b-contact-1"


def batch(request: int, begun: int, patches: list[dict], **flags) -> tuple[str, str, bytes]:
    body = {"dbid": DB, "clientid": ADMIN, "request": request, "user": "admin", "begun": begun, "patches": patches,
            **flags}
    return ("entity-batches", samples.request_key(ADMIN, request), samples.encode(body))


def subscribe(device: str) -> dict:
    """A $zoneSubscription entity created by an ordinary patch (its own zone is "default")."""
    user, zone, actions = ZONE_SUBSCRIBERS[device]
    return {"collection": samples.SUBSCRIPTIONS, "zone": "default", "entity": f"sub-{device}",
            "ops": [{"op": "add", "path": "", "value": {"subjectZone": zone, "device": device, "user": user,
                                                        "actions": actions}}]}


def contact(entity: str, zone: str, ops: list[dict]) -> dict:
    return {"collection": "Contacts", "zone": zone, "entity": entity, "ops": ops}


def ack(device: str, **what) -> tuple[str, str, bytes]:
    user = ZONE_SUBSCRIBERS.get(device, ("dave",))[0]
    return ("notification-acks", device, samples.encode({"dbid": DB, "user": user, "device": device,
                                                         "begun": FUTURE + 100, **what}))


@pytest.mark.parametrize("driver_rows", [0, 10_000], ids=["spark-tasks", "small-work-in-the-driver"])
def test_subscriptions_zone_changes_changes_by_device_and_notifications(make_pipeline, driver_rows):
    pipeline = make_pipeline(driver_rows=driver_rows)
    created = [{"op": "add", "path": "firstName", "value": "Ann"}]
    # ---- slice 1: device1 and device2 subscribe to zone A; an entity is created in zone B
    r1 = run_slice(pipeline, [
        batch(1, 1415747086000, [subscribe("device1"), subscribe("device2")]),
        batch(2, 1415747086100, [contact(ENTITY_B, "B", created)]),
    ], K1)
    # ---- slice 2: an entity of zone A is created, updated and deleted; device3 subscribes to zone B
    broken = {"collection": samples.SUBSCRIPTIONS, "zone": "default", "entity": "sub-broken",  # no user: no subscription
              "ops": [{"op": "add", "path": "", "value": {"subjectZone": "A", "device": "device9"}}]}
    r2 = run_slice(pipeline, [
        batch(3, 1415747087000, [subscribe("device3"), broken]),
        batch(4, FUTURE + 1, [contact(ENTITY_A, "A", created)]),
        batch(5, FUTURE + 2, [contact(ENTITY_A, "A", [{"op": "replace", "path": "firstName", "value": "Bea"}])]),
        batch(6, FUTURE + 3, [contact(ENTITY_A, "A", [{"op": "remove", "path": ""}])]),
    ], K2)

    # 7. zone_changes: every update by zone; subscriptions under the zone they subscribe to
    def zone_rows(key):
        return sorted((r["entity"], r["zone"], r["subjectZone"], r["action"]) for r in rows(pipeline, "zone_changes", key))

    assert zone_rows(K1) == [(ENTITY_B, "B", "B", "created"), ("sub-device1", "default", "A", "created"),
                             ("sub-device2", "default", "A", "created")]
    assert zone_rows(K2) == [(ENTITY_A, "A", "A", "created"), (ENTITY_A, "A", "A", "deleted"),
                             (ENTITY_A, "A", "A", "updated"), ("sub-broken", "default", "default", "created"),
                             ("sub-device3", "default", "B", "created")]
    assert pipeline.materializations(r1)["zone_changes"]["zones"] == {"A": 2, "B": 1}
    assert pipeline.materializations(r2)["zone_changes"]["zones"] == {"A": 3, "B": 1, "default": 1}
    subject = {ENTITY_A: "A", ENTITY_B: "B", "sub-broken": "default",
               **{f"sub-{d}": z for d, (_, z, _) in ZONE_SUBSCRIBERS.items()}}
    n = partitions_of(pipeline, "zone-changes")
    assert partition_for("A", n) != partition_for("default", n)  # so the subscriptions' partition is telling
    zone_messages = messages_on(pipeline, "zone-changes")
    assert Counter(m["key"] for m in zone_messages) == {ENTITY_A: 3, ENTITY_B: 1, "sub-device1": 1,
                                                        "sub-device2": 1, "sub-device3": 1, "sub-broken": 1}
    # a key's messages in the order its changes applied (by offset: created, updated, deleted), so
    # compaction keeps the deletion
    changes_of_a = sorted((m["offset"], m["value"]["begun"], m["value"]["ops"]) for m in zone_messages
                          if m["key"] == ENTITY_A)
    assert [begun for _, begun, _ in changes_of_a] == [FUTURE + 1, FUTURE + 2, FUTURE + 3]
    assert changes_of_a[-1][2] == [{"op": "remove", "path": ""}]
    for m in zone_messages:  # keyed by entity, partitioned by (subject) zone, the entity-updates structure
        assert m["partition"] == partition_for(subject[m["key"]], n), m
        assert m["value"]["entity"] == m["key"] and m["value"]["status"] == 1
        messages.parse_message(messages.EntityUpdate, json.dumps(m["value"]))

    # 5. the seed's two-device example: subscriptions of slice 1 are in effect in slice 2
    # slice 1 changed zone B only, which nobody watched yet; device3's later subscription does not reach back
    assert rows(pipeline, "changes_by_device", K1) == []
    changes = rows(pipeline, "changes_by_device", K2)
    assert sorted((r["device"], r["action"]) for r in changes) == [
        ("device1", "created"), ("device1", "deleted"),
        ("device2", "created"), ("device2", "deleted"), ("device2", "updated")]
    request_of = {"created": 4, "updated": 5, "deleted": 6}
    for r in changes:
        assert (r["dbid"], r["collection"], r["zone"], r["entity"]) == (DB, "Contacts", "A", ENTITY_A)
        assert r["ended"] == FUTURE + request_of[r["action"]] - 3
        assert r["user"] == ZONE_SUBSCRIBERS[r["device"]][0]
        # deterministic: uuid5 of the device and the change's identity (the patch)
        assert r["notification"] == notify.notification_id(r["device"], DB, "Contacts", "A", ENTITY_A, ADMIN,
                                                            request_of[r["action"]], 1)
    assert len({r["notification"] for r in changes}) == 5
    ids = {(r["device"], r["action"]): r["notification"] for r in changes}
    # the subscription without a user notifies nobody, and the check says so with its key and why
    assert pipeline.checks(r1)["subscriptions_are_valid"].passed is True
    check = pipeline.checks(r2)["subscriptions_are_valid"]
    assert check.passed is False and check.severity == AssetCheckSeverity.WARN
    assert check.metadata["first"].value == {f"{DB}/default/sub-broken": "user: Field required"}
    assert pipeline.materializations(r2)["changes_by_device"]["invalid_subscriptions"] == 1
    assert pipeline.materializations(r2)["changes_by_device"]["subscriptions"] == 3

    by_device = messages_on(pipeline, "changes-by-device")
    n = partitions_of(pipeline, "changes-by-device")
    assert sorted((m["key"], m["value"]["action"]) for m in by_device) == sorted(ids)
    seed_fields = {"dbid", "db", "collection", "zone", "entity", "notification", "action", "ended"}
    for m in by_device:
        value = m["value"]
        assert set(value) == seed_fields  # the device is the key, not part of the message
        assert m["partition"] == partition_for(m["key"], n)
        assert value["notification"] == ids[(m["key"], value["action"])]
        assert (value["db"], value["dbid"], value["collection"], value["zone"], value["entity"]) == (
            DB, DB, "Contacts", "A", ENTITY_A)
        assert value["ended"] == FUTURE + request_of[value["action"]] - 3
        messages.parse_message(messages.ChangeByDevice, json.dumps(value))

    # 8. device_notifications after slice 2: every notification unacknowledged
    def notifications(key):
        return {r["device"]: (r["user"], r["count"], r["begun"], r["ended"])
                for r in rows(pipeline, "device_notifications", key)}

    assert notifications(K2) == {"device1": ("alice", 2, FUTURE + 1, FUTURE + 3),
                                 "device2": ("bob", 3, FUTURE + 1, FUTURE + 3)}

    # ---- slice 3: ENTITY_B is updated (device3, subscribed in slice 2, hears of it); acks by id and upTo
    r3 = run_slice(pipeline, [
        batch(7, FUTURE + 10, [contact(ENTITY_B, "B", [{"op": "replace", "path": "firstName", "value": "Cy"}])]),
        ack("device2", notifications=[ids[("device2", "created")], "never-sent"]),  # an app's bug: counted
        ack("device1", upTo=FUTURE + 1),  # covers its created notification only
        ack("device4", upTo=samples.ACK_ALL),  # a device with no notifications: nothing changes
    ], K3)

    # 6. a subscription of slice 2 receives slice 3's changes (and, above, none of slice 1's)
    [late] = rows(pipeline, "changes_by_device", K3)
    assert (late["device"], late["user"], late["entity"], late["zone"], late["action"], late["ended"]) == (
        "device3", "carol", ENTITY_B, "B", "updated", FUTURE + 10)
    assert {(r["device"], r["entity"]) for r in rows(pipeline, "changes_by_device")} == {
        ("device1", ENTITY_A), ("device2", ENTITY_A), ("device3", ENTITY_B)}

    # 8. acks of a later slice lower the counts; one message per device whose count changed
    assert notifications(K3) == {"device1": ("alice", 1, FUTURE + 3, FUTURE + 3),
                                 "device2": ("bob", 2, FUTURE + 2, FUTURE + 3),
                                 "device3": ("carol", 1, FUTURE + 10, FUTURE + 10)}
    assert pipeline.materializations(r3)["device_notifications"]["acks"] == 3
    assert pipeline.materializations(r3)["device_notifications"]["unmatched_ack_ids"] == 1
    # an ack's trace ends at its device's inbox as it is now (a device with none: no inbox)
    acks = {r["device"]: r for r in rows(pipeline, "notification_acks", K3)}
    trail = trace.trace(pipeline.engine, *(acks["device2"][c] for c in ("kafka_topic", "kafka_partition", "kafka_offset")))
    [inbox] = trail.states["device_inboxes"]
    assert (inbox["device"], inbox["user"], inbox["count"], inbox["slice"]) == ("device2", "bob", 2, K3)
    assert f"device_inboxes        now: device=device2 user=bob count=2 ended={FUTURE + 3} slice={K3}" \
        in trace.format_trail(trail)
    assert "device_inboxes" not in trace.trace(pipeline.engine, *(acks["device4"][c] for c in (
        "kafka_topic", "kafka_partition", "kafka_offset"))).states
    assert pipeline.checks(r3)["one_inbox_per_device"].passed is True
    published = messages_on(pipeline, "device-notifications")
    n = partitions_of(pipeline, "device-notifications")
    assert sorted((m["key"], m["value"]["count"]) for m in published) == [
        ("device1", 1), ("device1", 2), ("device2", 2), ("device2", 3), ("device3", 1)]
    latest = {}
    for m in sorted(published, key=lambda m: m["timestamp"]):
        value = m["value"]
        assert m["key"] == value["device"] and m["partition"] == partition_for(m["key"], n)
        messages.parse_message(messages.DeviceNotification, json.dumps(value))
        latest[m["key"]] = (value["user"], value["count"], value["begun"], value["ended"])
    assert latest == notifications(K3)

    # a state's changes since a slice: each key a later slice changed, once, as it is now (a
    # deletion with `deleted` set), read from the files a later slice wrote only
    read = []

    def changed(since):
        return sorted((r["entity"], r["slice"], r["deleted"]) for t in pipeline.engine.changes("entities", since)
                      for r in t.to_pylist())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(storage, "read_tables", lambda files, *args: read.append(len(files)) or read_tables(files, *args))
        assert changed(K2) == [(ENTITY_B, K3, False)] and read == [1]  # one bucket file was rewritten by slice 3
        assert changed(K1) == [(ENTITY_A, K2, True), (ENTITY_B, K3, False), ("sub-broken", K2, False),
                               ("sub-device3", K2, False)]
    assert len(changed(None)) == len(rows(pipeline, "entities")) == 6

    # row-level lineage: the update of slice 2 (request 5), from its Kafka record down to device2's inbox,
    # whose notification of it no ack of slice 3 covered
    [record] = [r for r in rows(pipeline, "entity_batches", K2) if r["request"] == 5]
    trail = trace.trace(pipeline.engine, record["kafka_topic"], record["kafka_partition"], record["kafka_offset"])
    assert trail.slice == K2
    assert {t: len(found) for t, found in trail.rows.items()} == {
        "entity_batches": 1, "entity_patches": 1, "entity_updates": 1, "partial_responses": 1,
        "complete_responses": 1, "zone_changes": 1, "changes_by_device": 1}
    assert trail.rows["entity_updates"][0]["action"] == "updated"
    assert trail.inboxes == [{"device": "device2", "notifications": [ids[("device2", "updated")]],
                              "count_after_slice": 3, "count_now": 2,
                              "unacknowledged": [ids[("device2", "updated")]]}]
    # the creation (request 4) notified both devices; slice 3's acks covered both notifications
    [record] = [r for r in rows(pipeline, "entity_batches", K2) if r["request"] == 4]
    trail = trace.trace(pipeline.engine, record["kafka_topic"], record["kafka_partition"], record["kafka_offset"])
    assert [(i["device"], i["count_after_slice"], i["count_now"], i["unacknowledged"]) for i in trail.inboxes] == [
        ("device1", 2, 1, []), ("device2", 3, 2, [])]
    text = trace.format_trail(trail)
    assert f"slice {K2}" in text and "device=device1 count after the slice=2 now=1 unacknowledged=0 of 1" in text
    # ... and its entity, as the state holds it now: deleted by request 6 of the same slice
    [entity] = trail.states["entities"]
    assert (entity["entity"], entity["zone"], entity["deleted"], entity["document"], entity["slice"]) == (
        ENTITY_A, "A", True, None, K2)
    assert f"entities              now: collection=Contacts zone=A entity={ENTITY_A} version=3 deleted=true slice={K2}" \
           in text
    # a record of slice 1 whose entity a later slice changed: the state's row says which
    [record_b] = [r for r in rows(pipeline, "entity_batches", K1) if r["request"] == 2]
    [entity] = trace.trace(pipeline.engine, record_b["kafka_topic"], record_b["kafka_partition"],
                           record_b["kafka_offset"]).states["entities"]
    assert (entity["entity"], entity["version"], entity["slice"], json.loads(entity["document"])) == (
        ENTITY_B, 2, K3, {"firstName": "Cy"})
    # the same from the UI: trace_job, configured with the record (its stream's name for the topic)
    traced = pipeline.defs.resolve_job_def("trace_job").execute_in_process(
        run_config={"ops": {"trace_record": {"config": {
            "record": f"entity-batches:{record['kafka_partition']}:{record['kafka_offset']}"}}}},
        instance=pipeline.instance)
    [output] = [e for e in traced.all_events if e.event_type_value == "STEP_OUTPUT"]
    metadata = {k: v.value for k, v in output.event_specific_data.metadata.items()}
    assert metadata["slice"] == K2 and metadata["trail"] == f"```\n{text}\n```"
    assert metadata["devices"] == {"count": len(trail.inboxes), "first": trail.inboxes}
    assert metadata["states"] == {"entities": [{k: v for k, v in e.items() if k != "document"}
                                               for e in trail.states["entities"]]}
    # an entity's history from the UI: history_job, configured with the entity and a time or a slice
    def history_run(**when):
        return pipeline.defs.resolve_job_def("history_job").execute_in_process(
            run_config={"ops": {"entity_versions": {"config": {
                "dbid": DB, "collection": "Contacts", "zone": "A", "entity": ENTITY_A, **when}}}},
            instance=pipeline.instance, raise_on_error=False)

    def history_metadata(result):
        [output] = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
        return {k: v.value for k, v in output.event_specific_data.metadata.items()}

    latest = history_metadata(history_run())
    assert (latest["versions"], latest["version"], latest["deleted"], latest["as_of"]) == (3, 3, True, "now")
    assert "document" not in latest and latest["history"].count("\n| v") == 3
    created = history_metadata(history_run(at=FUTURE + 1))
    assert (created["version"], created["document"]) == (1, {"firstName": "Ann"})
    [failure] = [e for e in history_run(slice=1).all_events if e.is_step_failure]
    assert f"{DB}/Contacts/A/{ENTITY_A} did not exist as of slice 1" in pipeline.failure_text(failure)
    missing = pipeline.defs.resolve_job_def("trace_job").execute_in_process(
        run_config={"ops": {"trace_record": {"config": {"record": "entity-batches:0:999999"}}}},
        instance=pipeline.instance, raise_on_error=False)
    [failure] = [e for e in missing.all_events if e.is_step_failure]
    assert "in no slice (the sensor has not closed one" in pipeline.failure_text(failure)

    # 5. a re-run of slice 2 (replayed against the state of slice 1) yields the same notification ids
    again = pipeline.run(K2)
    assert again.success
    rerun = rows(pipeline, "changes_by_device", K2)
    assert {(r["device"], r["action"]): r["notification"] for r in rerun} == ids
    assert len(rerun) == 5
    assert notifications(K2) == {"device1": ("alice", 2, FUTURE + 1, FUTURE + 3),
                                 "device2": ("bob", 3, FUTURE + 1, FUTURE + 3)}
    # The device_inboxes state itself is checked by test_an_inbox_is_stored_in_its_own_bucket.

    # lake maintenance: a vacuum that keeps nothing old but what a replay of the last slice reads;
    # the last slice replays, the next one runs on the live state, and after the next vacuum a
    # replay of the slice before it, whose state is gone, is refused, saying why
    lake = LakeResource(root=pipeline.lake.root, vacuum_retention_hours=0)
    assert lake_maintenance.execute_in_process(resources={"lake": lake}, instance=pipeline.instance).success
    assert pipeline.run(K3).success
    run_slice(pipeline, [ack("device3", upTo=samples.ACK_ALL)], K4)
    assert notifications(K4) == {"device3": ("carol", 0, FUTURE + 10, FUTURE + 10)}
    assert lake_maintenance.execute_in_process(resources={"lake": lake}, instance=pipeline.instance).success
    replay = pipeline.run(K3, raise_on_error=False)
    assert not replay.success
    [failure] = [e for e in replay.all_events if e.is_step_failure]
    assert "cannot be replayed" in str(failure.step_failure_data.error) and "vacuum" in str(
        failure.step_failure_data.error)


def test_a_device_hears_of_a_slice_s_changes_in_the_order_they_were_applied(pipeline):
    """The fan-out's tasks split a device's change summaries by zone-changes file (so by entity
    bucket); device_notifications publishes them, each device's in the fold's order (begun,
    clientid, request, part): an entity's changes as applied, whatever their `ended` (equal, or
    the Kafka timestamps of records that arrived in another order) and their notification ids."""
    def ids(entity, requests):
        return [notify.notification_id("device2", DB, "Contacts", "A", entity, ADMIN, r, 1) for r in requests]

    # requests whose notification ids are out of request order: no tie-break on ids passes
    late_at = next(r for r in range(200, 300) if ids("late", [r]) > ids("late", [r + 1]))
    tied_at = next(r for r in range(100, 200, 4) if ids("tied", range(r, r + 4)) != sorted(ids("tied", range(r, r + 4))))
    run_slice(pipeline, [batch(1, 1415747086000, [subscribe("device2")])], K1)
    entities = [f"a-contact-{i:02}" for i in range(24)]
    late = [batch(late_at + 1, 1415747090000, [contact("late", "A", [{"op": "add", "path": "n", "value": 2}])]),
            batch(late_at, 1415747089000, [contact("late", "A", [{"op": "add", "path": "n", "value": 1}])])]
    tied = [batch(tied_at + i, FUTURE + 100, [contact("tied", "A", ops)]) for i, ops in enumerate([
        [{"op": "add", "path": "n", "value": 1}], [{"op": "replace", "path": "n", "value": 2}],
        [{"op": "remove", "path": ""}], [{"op": "add", "path": "n", "value": 3}]])]
    run_slice(pipeline, late + [batch(10 + i, FUTURE + i, [contact(e, "A", [{"op": "add", "path": "n", "value": i}])])
                                for i, e in enumerate(entities)] + tied, K2)
    heard = [(m["value"]["entity"], m["value"]["action"]) for m in messages_on(pipeline, "changes-by-device")
             if m["key"] == "device2"]
    assert heard == [("late", "created"), ("late", "updated"), *((e, "created") for e in entities),
                     ("tied", "created"), ("tied", "updated"), ("tied", "deleted"), ("tied", "created")]
    assert sorted(r["request"] for r in rows(pipeline, "changes_by_device", K2) if r["entity"] == "tied") == [
        tied_at + i for i in range(4)]  # each summary's request, by which it is ordered


def test_a_subscription_moved_to_another_zone_is_a_change_in_both_zones(pipeline):
    """zone-changes is compacted: each partition keeps a key's last message there. A subscription
    moved from zone A must therefore reach A's partition too, saying where it went, or A's
    partition holds it as watching A for good."""
    run_slice(pipeline, [batch(1, 1415747086000, [subscribe("device1")])], K1)  # device1 watches A
    n = partitions_of(pipeline, "zone-changes")
    other = next(z for z in "BCDEFGH" if partition_for(z, n) != partition_for("A", n))
    sub = {"collection": samples.SUBSCRIPTIONS, "zone": "default", "entity": "sub-device1"}
    r2 = run_slice(pipeline, [
        batch(2, 1415747087000, [{**sub, "ops": [{"op": "replace", "path": "subjectZone", "value": other}]}],
              includeAfter=True),
        batch(3, 1415747088000, [{**sub, "ops": [{"op": "replace", "path": "actions", "value": ["created"]}]}],
              includeAfter=True),
    ], K2)
    assert sorted((r["request"], r["subjectZone"]) for r in rows(pipeline, "zone_changes", K2)) == [
        (2, "A"), (2, other), (3, other)]
    assert pipeline.materializations(r2)["zone_changes"]["zones"] == {other: 2, "A": 1}
    assert rows(pipeline, "changes_by_device", K2) == []  # a subscription's changes notify nobody

    heard = {}  # partition -> the subscription's messages there, in offset order
    for m in messages_on(pipeline, "zone-changes"):
        assert m["key"] == "sub-device1"
        heard.setdefault(m["partition"], []).append((m["value"]["request"], m["value"].get("after", {}).get("subjectZone")))
    assert heard == {partition_for("A", n): [(1, None), (2, other)], partition_for(other, n): [(2, other), (3, other)]}


def test_app_version_counts_come_from_the_commit_before_or_from_an_older_lake_s_state(tmp_path):
    """Each devices commit records the counts of the state it makes; a lake written before that
    (no counts on its commits), or whose commit left the log, has them counted from the state's
    appVersion column once."""
    from deltalake import DeltaTable

    from entity_assets.assets.devices import _app_versions_before
    from entity_assets.storage import DeltaRsEngine, FileWriter
    from entity_assets.tables import SCHEMAS

    engine = DeltaRsEngine(str(tmp_path))
    engine.ensure("devices", SCHEMAS["devices"])
    writer = FileWriter("devices", engine.uri("devices"), SCHEMAS["devices"], K1, stats_columns=("slice", "bucket"))
    for device, version in (("d1", "1.0"), ("d2", "1.0"), ("d3", "2.0")):
        writer.append({"slice": K1, "dbid": DB, "user": "u", "device": device, "appVersion": version, "bucket": 0})
    common.commit_state(engine, "devices", K1, writer.close(), [])  # as an older release committed it
    assert _app_versions_before(engine, K1) == {}
    assert _app_versions_before(engine, K2) == {"1.0": 2, "2.0": 1}
    common.commit_state(engine, "devices", K2, [], [], metadata={"app_versions": json.dumps({"1.0": 1, "2.1": 2})})
    assert _app_versions_before(engine, K3) == {"1.0": 1, "2.1": 2}  # recorded: the state is not read
    # another Delta engine cleans the log at the retention lake_maintenance set, up to a checkpoint
    # after slice 2's commit (lake_maintenance itself keeps the commit of a table's last slice)
    engine.expire_log("devices", 0)  # sets the table's log retention: a commit
    table = DeltaTable(engine.uri("devices"))
    table.create_checkpoint()
    table.cleanup_metadata()
    assert engine.commit_after("devices", K2, "apply") is None
    assert _app_versions_before(engine, K3) == {"1.0": 2, "2.0": 1}


def test_an_inbox_is_stored_in_its_own_bucket(tmp_path):
    """A regression: device_inboxes once held device1 twice (pending 2 and 1) after slice 3.

    Pure Python (no broker, no Spark): one Spark task of device_notifications that owns two
    buckets, device1's (6) and then device4's (9).
    The driver replaces the state files a task reports as replaced by its rewrites.
    """
    import zlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from entity_assets import fold

    uris = {t: str(tmp_path / t) for t in ("device_notifications", "device_inboxes")}
    for uri in uris.values():
        Path(uri).mkdir()
    columns = pa.schema([("dbid", pa.string()), ("user", pa.string()), ("device", pa.string()),
                         ("kind", pa.string()), ("notification", pa.string()), ("ended", pa.int64()),
                         ("notifications", pa.string()), ("upTo", pa.int64()), ("bucket", pa.int32())])

    def event(device, kind, notification=None, ended=0, up_to=None, user="alice"):
        return {"dbid": DB, "user": user, "device": device, "kind": kind, "notification": notification,
                "ended": ended, "notifications": None, "upTo": up_to, "bucket": zlib.crc32(device.encode()) % 32}

    def task(events, key, state_files):
        batches = fold.inbox_task(iter([pa.RecordBatch.from_pylist(events, schema=columns)]), slice_key=key,
                                  uris=uris, storage_options=None, state_files=state_files, write_state=True)
        report = [f for b in batches for f in b.to_pylist()]
        return ([f for f in report if f["table"] == "device_inboxes"],
                [f["path"] for f in report if f["table"] == fold.REPLACED + "device_inboxes"])

    assert [event(d, "")["bucket"] for d in ("device1", "device4")] == [6, 9]
    # a device shared by two users: its inbox names whom it was last notified for
    [first], _ = task([event("device1", fold.NOTIFY, "n1", 1), event("device1", fold.NOTIFY, "n2", 2, user="bob")], K1,
                      {})
    stored = TableFile(path=first["path"], uri=f"{uris['device_inboxes']}/{first['path']}", size=first["size"],
                       rows=first["rows"])
    written, replaced = task([event("device1", fold.ACK, up_to=1), event("device4", fold.ACK, up_to=samples.ACK_ALL)], K2,
                             {6: [stored]})
    # device1's file is rewritten and reported as replaced, with device1's new inbox in it
    assert [json.loads(f["stats"])["minValues"]["bucket"] for f in written] == [6]
    assert replaced == [stored.uri]
    stored = pq.read_table(f"{uris['device_inboxes']}/{written[0]['path']}").to_pylist()
    assert [(r["device"], r["user"], r["bucket"], list(json.loads(r["document"])["pending"])) for r in stored] == [
        ("device1", "bob", 6, ["n2"])]


def test_an_inbox_that_is_never_acknowledged_stays_bounded(tmp_path, monkeypatch):
    """A device that never acks (an app uninstalled) keeps notify.MAX_PENDING notifications, the
    newest; the slice counts those that expired. Pure Python, as the test above."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from entity_assets import fold, notify

    monkeypatch.setattr(notify, "MAX_PENDING", 3)
    uris = {t: str(tmp_path / t) for t in ("device_notifications", "device_inboxes")}
    for uri in uris.values():
        Path(uri).mkdir()
    events = [{"dbid": DB, "user": "alice", "device": "device1", "kind": fold.NOTIFY, "notification": f"n{i}",
               "ended": i, "notifications": None, "upTo": None, "bucket": 6} for i in range(5)]
    report = [f for b in fold.inbox_task(iter([pa.RecordBatch.from_pylist(events)]), slice_key=K1, uris=uris,
                                         storage_options=None, state_files={}, write_state=True)
              for f in b.to_pylist()]
    assert {f["table"]: f["rows"] for f in report}[fold.COUNTER + fold.EXPIRED_NOTIFICATIONS] == 2
    [inbox] = [pq.read_table(f"{uris['device_inboxes']}/{f['path']}").to_pylist()[0]
               for f in report if f["table"] == "device_inboxes"]
    assert json.loads(inbox["document"])["pending"] == {"n2": 2, "n3": 3, "n4": 4}
    [message] = [pq.read_table(f"{uris['device_notifications']}/{f['path']}").to_pylist()[0]
                 for f in report if f["table"] == "device_notifications"]
    assert (message["count"], message["begun"], message["ended"]) == (3, 2, 4)


def test_learn_schemas_refuses_a_slice_whose_schema_updates_are_not_committed(pipeline):
    """apply_patches commits its tables at once on an object store: a crash can leave schema_learning
    committed without schema_updates, whose statuses tell learn_schemas whether a declaration
    changed; read as none, the slice's declared change would never be learned."""
    from entity_assets.partitions import slices_partitions
    from entity_assets.tables import SCHEMAS

    engine = pipeline.engine
    engine.ensure("schema_learning", SCHEMAS["schema_learning"])
    engine.replace_slice("schema_learning", SCHEMAS["schema_learning"], [], K1)
    pipeline.instance.add_dynamic_partitions(slices_partitions.name, [K1])
    result = pipeline.run(K1, assets=["learned_schemas"], raise_on_error=False)
    [failure] = [e for e in result.all_events if e.is_step_failure]
    assert f"slice {K1}: schema_updates holds no rows of it yet" in pipeline.failure_text(failure)


def test_a_slice_without_learning_leaves_learned_schemas_as_they_were(pipeline):
    """Most slices of a deployment carry no learning request: learn_schemas then records the
    slice without reading or rewriting the summaries, which grow with every field name, and its
    check finds no learned entity at odds; the next learning slice goes on from them."""
    def learned():
        return sorted((r["dbid"], r["collection"], r["slice"], r["summary"], r["disagreements"])
                      for r in rows(pipeline, "learned_schemas"))

    graph = samples.GraphTraffic(samples.BatchTraffic(patches=60, entities=12, learning=True, seed=5), devices=3)
    first = run_slice(pipeline, list(graph.records()), K1)
    before = learned()
    plain = samples.BatchTraffic(patches=30, entities=12, learning=False, seed=6)
    failing = {**samples.SEED_SCHEMA_PATCH, "dbid": graph.batches.dbid, "request": 8, "parts": 1, "part": 1,
               "ops": [{"op": "remove", "path": "Nowhere"}]}  # a schema update, failed: no schema changes
    second = run_slice(pipeline, [*plain.records(), ("schema-patches", graph.batches.dbid, samples.encode(failing))],
                       K2)
    assert [r["status"] for r in rows(pipeline, "schema_updates") if r["slice"] == K2] == [3]
    assert learned() == before and {slice_ for _, _, slice_, _, _ in before} == {K1}
    assert pipeline.engine.applied("learned_schemas", "entity-assets") == 2
    assert pipeline.materializations(second)["learned_schemas"]["observed_this_slice"] == 0
    checks = [pipeline.checks(r)["entities_match_declared_schema"] for r in (first, second)]
    assert [c.passed for c in checks] == [False, True] and checks[0].metadata["disagreement_count"].value > 0
    ghost = {**samples.SEED_SCHEMA_PATCH, "dbid": graph.batches.dbid, "request": 10, "parts": 1, "part": 1,
             "ops": [{"op": "add", "path": "Ghost", "value": {"fields": {}}}]}  # declared, never learned
    run_slice(pipeline, [*samples.BatchTraffic(patches=30, entities=12, learning=True, seed=7).records(),
                         ("schema-patches", graph.batches.dbid, samples.encode(ghost))], K3)
    assert {r["observed"] for r in rows(pipeline, "learned_schemas") if r["collection"] == "Ghost"} == {0}
    observed = {(r["dbid"], r["collection"]): r["observed"] for r in rows(pipeline, "learned_schemas")}
    assert sum(observed.values()) > sum(json.loads(s)["observed"] for _, _, _, s, _ in before)
    # a slice that empties the declared schema has no learning rows (no entity type is left), and
    # still changes what is declared
    dbid = graph.batches.dbid
    emptied = {**samples.SEED_SCHEMA_PATCH, "dbid": dbid, "request": 9, "parts": 1, "part": 1,
               "ops": [{"op": "replace", "path": "", "value": {}}]}
    emptying = run_slice(pipeline, [("schema-patches", dbid, samples.encode(emptied))], K4)
    assert [r["status"] for r in rows(pipeline, "schema_updates") if r["slice"] == K4] == [1]
    assert not [r for r in rows(pipeline, "schema_learning") if r["slice"] == K4]
    left = [r for r in rows(pipeline, "learned_schemas") if r["dbid"] == dbid]
    assert {(r["slice"], r["declared"]) for r in left} == {(K4, None)}
    assert all(r["observed"] for r in left)  # a type declared, never learned, is gone with its declaration
    assert pipeline.materializations(emptying)["learned_schemas"]["observed_this_slice"] == 0


def test_a_small_slice_runs_the_whole_graph_without_a_spark_session_nor_spool_files(make_pipeline, monkeypatch):
    # A run that never needs Spark must not start a JVM (a run process of its own would pay 7-11 s),
    # and its tasks, run in the driver, keep their spools in memory (on an object store a spool
    # file is six requests in a row).
    from entity_assets import publish

    pipeline = make_pipeline(production_layout=True)

    def no_spark(self):
        raise AssertionError("a small slice asked for a Spark session")

    def no_spool_file(*args, **kwargs):
        raise AssertionError("a small slice wrote or read a spool file")

    monkeypatch.setattr(SparkResource, "session", no_spark)
    monkeypatch.setattr(publish, "filesystem", no_spool_file)
    traffic = samples.GraphTraffic(samples.BatchTraffic(patches=200, entities=40, learning=True), devices=10)
    result = run_slice(pipeline, list(traffic.records()), K1)
    assert all(rows(pipeline, t) for t in ("entity_updates", "learned_schemas", "devices", "changes_by_device"))
    assert len(messages_on(pipeline, "entity-updates")) == len(rows(pipeline, "entity_updates")) == \
        pipeline.materializations(result)["entity_updates"]["published"]
    assert len(messages_on(pipeline, "changes-by-device")) == len(rows(pipeline, "changes_by_device")) == \
        pipeline.observations(result)["kafka/changes-by-device"]["messages"]  # by device_notifications
