"""Devices, subscriptions, fan-out and device inboxes against the seed's zone-changes, changes-by-device
and device-notifications sections (seeds/004)."""

from __future__ import annotations

import uuid

import pytest

from entity_assets.messages import DeviceNotification, NotificationAck, ZoneSubscription
from entity_assets.notify import (
    SUBSCRIPTIONS,
    DeviceInbox,
    SubscriptionIndex,
    RECIPIENT_INPUTS,
    recipients,
    notification_id,
    parse_subscription,
    read_subscription,
    seen,
    subject_zones,
)

DB = "my-db"
CLIENT = "c297cf20-18bd-40e2-827d-9b563ca28ccd"
ENTITY = "101c3c90-e304-4279-b6a0-020363c925c6"


def sub(zone: str, device: str, actions: list[str], user: str = "jsmith", collection: str | None = None):
    doc = {"subjectZone": zone, "device": device, "user": user, "actions": actions}
    if collection is not None:
        doc["subjectCollection"] = collection
    return doc


def index_of(*docs: dict, dbid: str = DB) -> SubscriptionIndex:
    return SubscriptionIndex((dbid, "subs", f"sub-{i}", ZoneSubscription.model_validate(d)) for i, d in enumerate(docs))


def change(action: str, *, collection: str = "Contacts", zone: str = "A", request: int = 1, part: int = 1, **kw) -> dict:
    row = {
        "dbid": DB, "collection": collection, "zone": zone, "entity": ENTITY,
        "clientid": CLIENT, "request": request, "part": part, "ended": 1415747086328, "action": action, "status": 1,
    }
    row.update(kw)
    return row


@pytest.fixture
def seed_index() -> SubscriptionIndex:
    """The seed's example: device1 and device2 watch creations and deletions in zone A, only device2 updates."""
    return index_of(
        sub("A", "device1", ["created", "deleted"]),
        sub("A", "device2", ["created", "updated", "deleted"], user="jdoe"),
    )


# ---------------------------------------------------------------- actions and zones


def test_subscription_change_is_partitioned_by_subject_zone():
    doc = sub("A", "device1", ["created"])
    assert subject_zones(SUBSCRIPTIONS, "subs-zone", doc) == ("A", None)
    assert subject_zones("Contacts", "B", doc, doc) == ("B", None)  # only $zoneSubscription entities are redirected
    assert subject_zones(SUBSCRIPTIONS, "subs-zone", None) == ("subs-zone", None)
    assert subject_zones(SUBSCRIPTIONS, "subs-zone", {"device": "d"}) == ("subs-zone", None)
    # deleted, or no longer a subscription: the zone it watched sees it go
    assert subject_zones(SUBSCRIPTIONS, "subs-zone", None, doc) == ("A", None)
    assert subject_zones(SUBSCRIPTIONS, "subs-zone", {"device": "d"}, doc) == ("A", None)
    # moved: the zone it watches now, and the zone it left, which sees it go too
    assert subject_zones(SUBSCRIPTIONS, "subs-zone", sub("B", "device1", ["created"]), doc) == ("B", "A")
    assert subject_zones(SUBSCRIPTIONS, "subs-zone", sub("A", "device1", ["updated"]), doc) == ("A", None)
    assert subject_zones(SUBSCRIPTIONS, "subs-zone", doc, {"device": "d"}) == ("A", None)


# ---------------------------------------------------------------- subscriptions


def test_parse_subscription_defaults_and_invalid():
    parsed = parse_subscription({"subjectZone": "A", "device": "d", "user": "u"})
    assert parsed is not None
    assert parsed.subjectCollection is None and parsed.actions == ["created", "updated", "deleted"]
    for bad in (
        None,
        "not a dict",
        [],
        {},
        {"subjectZone": "A", "device": "d"},  # no user
        {"subjectZone": "", "device": "d", "user": "u"},
        {"subjectZone": "A", "device": "d", "user": "u", "actions": ["touched"]},
        {"subjectZone": "A", "device": "d", "user": "u", "actions": []},
        {"subjectZone": 7, "device": "d", "user": "u"},
    ):
        assert parse_subscription(bad) is None, bad
        assert read_subscription(bad)[1], bad
    assert read_subscription({"subjectZone": "A", "device": "d"}) == (None, "user: Field required")
    assert read_subscription(sub("A", "d", ["created"]))[1] is None


def test_the_state_s_subscriptions_are_read_as_read_subscription_reads_each(tmp_path):
    """changes_by_device parses the $zoneSubscription documents from their text, with the garbage
    collector paused: the same subscriptions, and the same words for the bad ones, as
    read_subscription of the parsed document; a deleted one left out, a null `deleted` kept."""
    import gc
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from entity_assets import core
    from entity_assets.assets.notifications import _subscriptions, _zones

    texts = [json.dumps(sub("A", "d1", ["created"])), json.dumps(sub("B", "d2", ["updated"], collection="Contacts")),
             json.dumps({"subjectZone": "A", "device": "d3", "user": "u", "actions": None}),
             '{"subjectZone": "A", "subjectZone": "C", "device": "d4", "user": "u"}',  # the last member wins
             '{"subjectZone": "A", "device": "d5", "user": "u", "extra": {"deep": [1, 2]}}',
             "[]", "7", "null", '"text"', "{}", json.dumps({"subjectZone": 7, "device": "d", "user": "u"}),
             json.dumps({"subjectZone": "A", "device": "d", "user": "u", "actions": ["touched"]}),
             json.dumps({"subjectZone": "A", "device": "d", "user": "u", "actions": []}),
             json.dumps({"subjectZone": "", "device": "d", "user": "u"}),
             json.dumps(sub("Z", "gone", ["created"]))]
    deleted = [False, None] + [False] * (len(texts) - 3) + [True]
    state = pa.table({"dbid": ["db"] * len(texts), "zone": ["subs"] * len(texts),
                      "entity": [f"s{i:02}" for i in range(len(texts))], "deleted": deleted, "document": texts})
    valid, invalid = _subscriptions(state)
    expected = [("db", "subs", f"s{i:02}", read_subscription(core.loads(text)))
                for i, text in enumerate(texts) if not deleted[i]]
    assert valid == [(d, z, e, read[0]) for d, z, e, read in expected if read[0] is not None]
    assert invalid == [(d, z, e, read[1]) for d, z, e, read in expected if read[0] is None]
    assert [s.device for *_, s in valid] == ["d1", "d2", "d3", "d4", "d5"] and valid[3][3].subjectZone == "C"
    assert len(invalid) == 9 and ("db", "subs", "s05", "the document is not an object") in invalid
    assert gc.isenabled()
    assert _subscriptions(state.slice(0, 0)) == ([], [])

    pq.write_table(pa.table({"dbid": ["db", "db", "db2"], "zone": ["A", "A", "A"], "x": [1, 2, 3]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"dbid": ["db"], "zone": ["C"], "x": [4]}), tmp_path / "b.parquet")
    assert _zones([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], None) == {("db", "A"), ("db2", "A"), ("db", "C")}
    assert _zones([], None) == set()


def test_subscriptions_of_one_id_in_two_zones_are_two_subscriptions():
    """Entity ids are unique within a zone: keyed by id alone, one subscription hid the other."""
    index = SubscriptionIndex([(DB, "X", "sub-1", ZoneSubscription.model_validate(sub("A", "d1", ["created"]))),
                               (DB, "Y", "sub-1", ZoneSubscription.model_validate(sub("B", "d2", ["created"])))])
    assert len(index) == 2
    assert index.devices_for(DB, "Contacts", "A", "created") == [("d1", "jsmith")]
    assert index.devices_for(DB, "Contacts", "B", "created") == [("d2", "jsmith")]


def test_devices_for_sorted_unique(seed_index):
    assert seed_index.devices_for(DB, "Contacts", "A", "created") == [("device1", "jsmith"), ("device2", "jdoe")]
    assert seed_index.devices_for(DB, "Contacts", "A", "updated") == [("device2", "jdoe")]
    assert seed_index.devices_for(DB, "Contacts", "B", "created") == []
    assert seed_index.devices_for("other-db", "Contacts", "A", "created") == []
    dup = index_of(sub("A", "d", ["created"]), sub("A", "d", ["created", "updated"]))
    assert dup.devices_for(DB, "X", "A", "created") == [("d", "jsmith")]


def test_later_version_of_a_subscription_replaces_earlier():
    first = ZoneSubscription.model_validate(sub("A", "d", ["created"]))
    moved = ZoneSubscription.model_validate(sub("B", "d", ["created"]))
    index = SubscriptionIndex([(DB, "subs", "s1", first), (DB, "subs", "s1", moved)])
    assert len(index) == 1
    assert index.devices_for(DB, "X", "A", "created") == []
    assert index.devices_for(DB, "X", "B", "created") == [("d", "jsmith")]


# ---------------------------------------------------------------- fan-out


def fan_out(row: dict, index: SubscriptionIndex) -> list[tuple[str, str, str]]:
    """(device, user, notification) of each device the change `row` notifies."""
    return recipients(index, *(row[name] for name in RECIPIENT_INPUTS))


def test_seed_example_two_devices(seed_index):
    created = fan_out(change("created"), seed_index)
    assert [(device, user) for device, user, _ in created] == [("device1", "jsmith"), ("device2", "jdoe")]
    updated = fan_out(change("updated", request=2), seed_index)
    assert [device for device, _, _ in updated] == ["device2"]
    deleted = fan_out(change("deleted", request=3), seed_index)
    assert [device for device, _, _ in deleted] == ["device1", "device2"]


def test_subject_collection_filter():
    index = index_of(
        sub("A", "contacts-only", ["created"], collection="Contacts"),
        sub("A", "everything", ["created"]),
    )
    assert [device for device, _, _ in fan_out(change("created"), index)] == ["contacts-only", "everything"]
    assert [device for device, _, _ in fan_out(change("created", collection="Orders"), index)] == ["everything"]


def test_subscription_change_notifies_nobody():
    index = index_of(sub("A", "d", ["created", "updated", "deleted"]))
    row = change("created", collection=SUBSCRIPTIONS, zone="A")
    assert fan_out(row, index) == []


def test_failed_update_notifies_nobody(seed_index):
    assert fan_out(change("created", status=3), seed_index) == []
    assert len(fan_out(change("created", status=1), seed_index)) == 2


def test_invalid_subscription_document_is_ignored():
    docs = [sub("A", "good", ["created"]), {"subjectZone": "A", "device": "bad"}, None, {"actions": "created"}]
    valid = [(DB, "subs", f"s{i}", s) for i, d in enumerate(docs) if (s := parse_subscription(d)) is not None]
    index = SubscriptionIndex(valid)
    assert [device for device, _, _ in fan_out(change("created"), index)] == ["good"]


def test_device_under_two_users_gets_one_row():
    index = index_of(sub("A", "shared", ["created"], user="zoe"), sub("A", "shared", ["created"], user="amy"))
    rows = fan_out(change("created"), index)
    assert [(device, user) for device, user, _ in rows] == [("shared", "amy")]


# ---------------------------------------------------------------- notification ids


def test_notification_ids_deterministic_and_distinct(seed_index):
    args = (DB, "Contacts", "A", ENTITY, CLIENT, 1, 1)
    a = notification_id("device1", *args)
    assert a == notification_id("device1", *args)
    assert uuid.UUID(a).version == 5
    assert a != notification_id("device2", *args)
    assert a != notification_id("device1", DB, "Contacts", "A", ENTITY, CLIENT, 1, 2)
    assert a != notification_id("device1", DB, "Contacts", "A", ENTITY, CLIENT, 2, 1)
    # a re-run of the same slice mints the same ids
    first = fan_out(change("created"), seed_index)
    again = fan_out(change("created"), seed_index)
    assert first == again
    assert len({notification for _, _, notification in first}) == 2


def test_notification_ids_are_those_of_earlier_releases():
    """Acks name notifications by id: the id of a change must never change across releases."""
    import json
    import random

    rng = random.Random(7)
    alphabet = 'abcXYZ019-_/ "\\\u00e9\u4e2d\U0001f600\n\t'
    for _ in range(500):
        fields = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(6)]
        request, part = rng.randint(0, 2**40), rng.randint(1, 50)
        released = str(uuid.uuid5(uuid.UUID("99fb1246-4957-4343-9e87-e2a28809f337"), json.dumps([*fields, request, part])))
        assert notification_id(*fields, request, part) == released


# ---------------------------------------------------------------- device inbox


def test_inbox_add_count_begun_ended():
    inbox = DeviceInbox(DB, "jsmith", "device1")
    assert inbox.count == 0 and inbox.begun is None and inbox.ended is None
    inbox.add("n2", 200)
    inbox.add("n1", 100)
    inbox.add("n3", 300)
    assert inbox.add("n1", 100) is False  # re-run: idempotent, the inbox unchanged
    assert (inbox.count, inbox.begun, inbox.ended) == (3, 100, 300)


def test_inbox_ack_by_id_and_up_to():
    inbox = DeviceInbox(DB, "jsmith", "device1", {"n1": 100, "n2": 200, "n3": 300, "n4": 400})
    assert inbox.ack(["n2", "unknown"]) == (1, 1)  # one removed, one named that was not pending
    assert (inbox.count, inbox.begun, inbox.ended) == (3, 100, 400)
    assert inbox.ack(["n2"]) == (0, 1)  # already acknowledged
    assert inbox.ack(up_to=300) == (2, 0)  # n1, n3 (ended <= upTo)
    assert (inbox.count, inbox.begun, inbox.ended) == (1, 400, 400)
    assert inbox.ack(["n4"], up_to=50) == (1, 0)
    assert inbox.count == 0 and inbox.begun is None


def test_an_id_an_ack_names_twice_is_acknowledged_once_and_not_missed():
    """The second copy was counted as not pending: an app's bug where there is none."""
    pending = "0b5f1c9e-6d1a-5c2e-9f3b-7a8d4e2c1b00"
    inbox = DeviceInbox(DB, "jsmith", "device1", {pending: 100, "n2": 200})
    assert inbox.ack([pending, pending.upper(), pending]) == (1, 0) and inbox.count == 1


def test_a_pending_id_added_again_leaves_the_inbox_as_it_was():
    """Its `ended` was kept and the inbox not saved, yet the newest time moved: what an emptied
    inbox then said depended on whether another notification came in the same slice."""
    inbox = DeviceInbox(DB, "jsmith", "device1", {"n1": 100})
    assert inbox.add("n1", 500) is False and (inbox.pending, inbox.last) == ({"n1": 100}, 100)
    inbox.ack(["n1"])
    assert inbox.message()["ended"] == 100


def test_an_ack_names_an_id_in_any_case():
    """Ids are lowercase UUIDs; an app's UUID type may give one back in capitals (Swift's uuidString)."""
    pending = "0b5f1c9e-6d1a-5c2e-9f3b-7a8d4e2c1b00"
    inbox = DeviceInbox(DB, "jsmith", "device1", {pending: 100})
    assert inbox.ack([pending.upper()]) == (1, 0) and inbox.count == 0


def test_inbox_ack_from_notification_ack_message():
    inbox = DeviceInbox(DB, "jsmith", "device1")
    for n, t in (("n1", 10), ("n2", 20), ("n3", 30)):
        inbox.add(n, t)  # earlier slices' notifications, which the app has seen
    ack = NotificationAck.model_validate(
        {"db": DB, "user": "jsmith", "device": "device1", "notifications": ["n3"], "upTo": 10, "begun": 1}
    )
    assert inbox.ack(ack.notifications, ack.upTo)[0] == 2
    assert list(inbox.pending) == ["n2"]


def test_an_inbox_past_its_limit_keeps_its_newest_notifications():
    inbox = DeviceInbox(DB, "jsmith", "device1", {"n1": 100, "n2": 300, "n3": 200, "n0": 100, "n4": 400})
    assert inbox.expire(5) == 0 and inbox.count == 5
    assert inbox.expire(3) == 2  # the oldest, n0 then n1 on equal ended
    assert inbox.pending == {"n2": 300, "n3": 200, "n4": 400}
    assert (inbox.count, inbox.begun, inbox.ended) == (3, 200, 400)
    assert inbox.expire(0) == 3 and inbox.message()["count"] == 0 and inbox.message()["ended"] == 400
    tied = DeviceInbox(DB, "jsmith", "device1", {"n1": 100, "n0": 100, "n2": 100})
    assert tied.expire(2) == 1 and sorted(tied.pending) == ["n1", "n2"]  # equal ended: the smaller id goes


def test_inbox_json_round_trip():
    inbox = DeviceInbox(DB, "jsmith", "device1", {"n1": 100, "n2": 200})
    inbox.ack(["n2"])
    back = DeviceInbox.from_json(inbox.to_json())
    assert (back.dbid, back.user, back.device, back.pending, back.last) == (DB, "jsmith", "device1", {"n1": 100}, 200)
    assert back.to_json() == inbox.to_json()
    assert back.message() == inbox.message()


def test_inbox_message_validates():
    inbox = DeviceInbox(DB, "jsmith", "7980f77c-2529-4978-9281-c44297c0f57e")
    inbox.add("n1", 1415747103842)
    inbox.add("n2", 1415747104012)
    inbox.add("n3", 1415747103900)
    msg = DeviceNotification.model_validate(inbox.message())
    assert (msg.dbid, msg.db, msg.count, msg.begun, msg.ended) == (DB, DB, 3, 1415747103842, 1415747104012)
    inbox.ack(up_to=1415747104012)
    empty = DeviceNotification.model_validate(inbox.message())
    assert (empty.count, empty.begun, empty.ended) == (0, 1415747104012, 1415747104012)
    never = DeviceNotification.model_validate(DeviceInbox(DB, "u", "d").message())
    assert (never.count, never.begun, never.ended) == (0, 0, 0)


def test_a_device_keeps_its_first_sight_and_the_app_version_of_its_latest_connection():
    def connection(begun, version, client=CLIENT):
        return {"dbid": DB, "user": "jsmith", "device": "d1", "clientid": client, "appVersion": version, "begun": begun}

    device = seen(None, connection(200, "1.0"))
    assert device == {"dbid": DB, "user": "jsmith", "device": "d1", "clientid": CLIENT, "appVersion": "1.0",
                      "firstSeen": 200, "lastSeen": 200, "connections": 1}
    device = seen(device, connection(100, "0.9", "old"))  # an earlier connection, arriving late
    assert (device["firstSeen"], device["lastSeen"], device["appVersion"], device["clientid"]) == (100, 200, "1.0", CLIENT)
    device = seen(device, connection(300, "1.1"))
    assert (device["firstSeen"], device["lastSeen"], device["appVersion"], device["connections"]) == (100, 300, "1.1", 3)
    assert seen(device, connection(300, "1.1")) == device  # the latest again (a producer's retry): counted once
    # a tie on begun: the greater app version, whatever the order of arrival
    assert seen(seen(None, connection(5, "2.0")), connection(5, "1.9"))["appVersion"] == "2.0"
    assert seen(seen(None, connection(5, "1.9")), connection(5, "2.0"))["appVersion"] == "2.0"
