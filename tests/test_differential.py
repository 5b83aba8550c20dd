"""The pipeline against a model: random traffic through real slices, compared with the patch engine.

The entity core's tasks do not call `patch.apply_patch` one patch at a time: they validate ops in
bulk, fold each state bucket's keys in Arrow, split work over tasks and state files, and skip
redeliveries through the lake. This test feeds the same seeded traffic to the pipeline (real
broker, Spark, Delta, Dagster) and to a model written from docs/entity-core.md alone: dedupe on
(clientid, request, part), slices in order, within a slice each entity's patches in (begun,
clientid, request, part) order, each applied with the patch engine to the state left by the
previous. Every result must agree: statuses, errors, before/after, actions, versions, tombstones,
complete responses, the published topics, and `learned_schemas` against one pass of the learner
over the documents of the requests that asked for learning.

The traffic mixes what production sees: creations, nested adds, appends, moves, copies, tests
that pass and fail, removes of missing paths (status 3), updates of entities that do not exist
(status 2), deletions and re-creations, multi-part batches, `begun` out of offset order, and
redeliveries within and across slices. The default size runs in the suite; the bench-sized one
(`-m slow`) runs production's task layout (large slices in Spark, the driver only for small ones).

The second test adds zone subscriptions that are created, changed, deleted and malformed from
slice to slice, and acknowledgements, and checks the fan-out (`zone_changes`, `changes_by_device`)
and the inboxes (`device_notifications`) against docs/streams.md the same way. The third sends
schema requests of several parts, one message per part, whose parts straddle slices and arrive
out of order, and checks `schema_updates`, `schemas`, pending and complete responses and the
entity-type rows of `schema_learning`.
"""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest

from entity_assets import core, history, samples
from entity_assets.learning import Summary
from entity_assets.patch import STATUS_OK, apply_patch
from entity_assets.slices import slice_key
from entity_assets.storage import read_table

SUBSCRIPTIONS = samples.SUBSCRIPTIONS
ACTIONS = ("created", "updated", "deleted")
NOTIFICATION_NAMESPACE = uuid.UUID("99fb1246-4957-4343-9e87-e2a28809f337")  # docs/streams.md: ids never change
DBID = "my-db"
BEGUN = samples.SEED_ENTITY_BATCH["begun"]


@dataclass
class MixedTraffic:
    """Seeded batches whose patches succeed, fail (statuses 2 and 3), delete and re-create."""

    entities: int
    seed: int
    clients: int = 5
    redeliver: float = 0.02
    zones: tuple[str, ...] = ("default", "A", "B")
    _rng: random.Random = field(init=False)

    def __post_init__(self):
        self._rng = random.Random(self.seed)
        rng = self._rng
        self.client_ids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(self.clients)]
        self.targets = [(("Contacts", "Groups")[i % 2], self.zones[i % len(self.zones)],
                         str(uuid.UUID(int=rng.getrandbits(128), version=4))) for i in range(self.entities)]
        self.requests = [0] * self.clients
        self.sent: list[tuple[str, str, bytes]] = []
        self.made = 0

    def records(self, batches: int) -> list[tuple[str, str, bytes]]:
        """The next `batches` batches, with redeliveries of earlier records mixed in."""
        rng, out = self._rng, []
        for _ in range(batches):
            if self.sent and rng.random() < self.redeliver:
                out.append(rng.choice(self.sent))
            c = rng.randrange(self.clients)
            self.requests[c] += 1
            patches = []
            for _ in range(rng.choice((1, 1, 1, 2, 3))):
                collection, zone, entity = rng.choice(self.targets)
                patches.append({"collection": collection, "zone": zone, "entity": entity, "ops": self._ops()})
            self.made += 1
            # begun drifts against offset order, and ties happen, so the order key decides
            message = {"dbid": DBID, "clientid": self.client_ids[c], "request": self.requests[c], "user": f"user{c}",
                       "begun": BEGUN + self.made * 5 + rng.randrange(-40, 40), "includeBefore": True,
                       "includeAfter": True, "learning": rng.random() < 0.5, "patches": patches}
            rec = ("entity-batches", samples.request_key(message["clientid"], message["request"]),
                   samples.encode(message))
            self.sent.append(rec)
            out.append(rec)
        return out

    def _ops(self) -> list[dict]:
        rng, n = self._rng, self.made
        kind = rng.random()
        if kind < 0.30:  # a creation, or an update of existing fields by add
            return [{"op": "add", "path": "firstName", "value": f"First{n}"},
                    {"op": "add", "path": "phone/home", "value": f"1-222-555-{rng.randrange(10000):04d}"},
                    {"op": "add", "path": "/tags", "value": [rng.randrange(5)]}]
        if kind < 0.45:
            return [{"op": "replace", "path": "firstName", "value": f"Re{n}"},
                    {"op": "add", "path": "/tags/-", "value": n % 7}]
        if kind < 0.55:
            return [{"op": "test", "path": "phone/home", "value": f"1-222-555-{rng.randrange(3):04d}"},
                    {"op": "add", "path": "lucky", "value": True}]
        if kind < 0.63:
            return [{"op": "move", "from": "/phone/home", "path": "/phone/work"},
                    {"op": "copy", "from": "/firstName", "path": "/nickname"}]
        if kind < 0.70:
            return [{"op": "remove", "path": "nickname"}]
        if kind < 0.76:
            return [{"op": "add", "path": "age", "value": rng.randrange(18, 90)}, {"op": "remove", "path": ""}]
        if kind < 0.82:  # fails at its second op on every document the traffic makes
            return [{"op": "add", "path": "a", "value": 1}, {"op": "remove", "path": "missing/field"}]
        if kind < 0.88:
            return [{"op": "test", "path": "/tags/0", "value": rng.randrange(5)},
                    {"op": "replace", "path": "/tags/0", "value": "x"}]
        if kind < 0.94:
            return [{"op": "remove", "path": "/phone"}, {"op": "add", "path": "phone/mobile", "value": str(n)}]
        return [{"op": "copy", "from": "/tags", "path": "/oldTags"}, {"op": "remove", "path": "/tags/0"}]


@dataclass
class Model:
    """docs/entity-core.md's order and dedupe over the patch engine: what the lake must hold."""

    state: dict = field(default_factory=dict)  # (collection, zone, entity) -> (version, document or None)
    results: dict = field(default_factory=dict)  # (clientid, request, part) -> result fields
    requests: dict = field(default_factory=dict)  # (clientid, request) -> parts

    def apply_slice(self, records: list[tuple[str, str, bytes]]) -> None:
        pending = []
        for _, _, value in records:
            batch = json.loads(value)
            if (batch["clientid"], batch["request"]) in self.requests:
                continue  # a redelivery: every part of it was seen
            self.requests[(batch["clientid"], batch["request"])] = len(batch["patches"])
            for part, p in enumerate(batch["patches"], start=1):
                pending.append(((batch["begun"], batch["clientid"], batch["request"], part),
                                {**p, "learning": batch.get("learning", False)}))
        for (begun, clientid, request, part), p in sorted(pending, key=lambda item: item[0]):
            key = (p["collection"], p["zone"], p["entity"])
            version, doc = self.state.get(key, (0, None))
            outcome = apply_patch(doc, p["ops"])
            result = {"status": outcome.status, "error": outcome.error, "before": None, "after": None, "action": None,
                      "collection": p["collection"], "zone": p["zone"], "entity": p["entity"],
                      "learning": p["learning"]}
            if outcome.status == STATUS_OK:
                action = "deleted" if outcome.deleted else "created" if doc is None else "updated"
                result.update(before=doc, after=outcome.doc, action=action)
                self.state[key] = (version + 1, outcome.doc)
            self.results[(clientid, request, part)] = result


def _json(text):
    return None if text is None else json.loads(text)


@pytest.mark.parametrize(("batches", "entities", "slices", "production"), [
    pytest.param(900, 120, 3, False, id="split-tasks"),
    pytest.param(100_000, 10_000, 3, True, id="bench-sized", marks=pytest.mark.slow),
])
def test_the_lake_agrees_with_the_patch_engine_in_slice_and_begun_order(make_pipeline, batches, entities, slices,
                                                                      production):
    pipeline = make_pipeline(max_messages_per_task=max(200, batches // 8), production_layout=production)
    traffic, model = MixedTraffic(entities=entities, seed=20261124), Model()
    for _ in range(slices):
        records = traffic.records(batches // slices)
        pipeline.produce(records)
        [request] = pipeline.tick()
        assert pipeline.run_request(request).success
        model.apply_slice(records)

    statuses = Counter(r["status"] for r in model.results.values())
    assert min(statuses[1], statuses[2], statuses[3]) > 0, statuses  # the traffic reaches every status

    responses = {(r["clientid"], r["request"], r["part"]): r for r in pipeline.read("partial_responses").to_pylist()}
    assert responses.keys() == model.results.keys()
    for k, expected in model.results.items():
        got = responses[k]
        assert (got["status"], got["error"], _json(got["before"]), _json(got["after"])) == (
            expected["status"], expected["error"], expected["before"], expected["after"]), k

    updates = {(r["clientid"], r["request"], r["part"]): r for r in pipeline.read("entity_updates").to_pylist()}
    assert updates.keys() == {k for k, r in model.results.items() if r["status"] == STATUS_OK}
    assert all(updates[k]["action"] == model.results[k]["action"] for k in updates)

    entities_ = {(r["collection"], r["zone"], r["entity"]): r for r in pipeline.read("entities").to_pylist()}
    assert entities_.keys() == model.state.keys()
    for key, (version, doc) in model.state.items():
        row = entities_[key]
        assert (row["version"], row["deleted"], _json(row["document"])) == (version, doc is None, doc), key

    # each entity's history, replayed from entity_updates, ends at its state; after each slice, it is
    # the state of the Delta version that slice committed
    updates_of = defaultdict(list)
    for r in pipeline.read("entity_updates").to_pylist():
        updates_of[(r["collection"], r["zone"], r["entity"])].append(r)
    histories = {key: history.versions(updates) for key, updates in updates_of.items()}
    assert histories.keys() == entities_.keys()

    def version_of(v: dict | None) -> tuple | None:
        return None if v is None else (v["version"], v["deleted"], v["document"], v["ended"])

    for k in range(1, slices + 1):
        then = pipeline.read("entities", version=pipeline.engine.version_after("entities", slice_key(k), "apply"))
        rows = {(r["collection"], r["zone"], r["entity"]): r for r in then.to_pylist()}
        assert {key: version_of(history.as_of(h, slice=k)) for key, h in histories.items()} == {
            key: version_of(rows[key] | {"document": _json(rows[key]["document"])}) if key in rows else None
            for key in histories}, k
    # entity_history follows an entity's slices back from its state row (each update names the
    # slice of its entity's update before its slice's): the same versions
    for updates in updates_of.values():
        slices = sorted({u["slice"] for u in updates})
        before = dict(zip(slices, [None, *slices]))
        assert [u["previousSlice"] for u in updates] == [before[u["slice"]] for u in updates]
    changed_most = sorted(histories, key=lambda key: (-len({v["slice"] for v in histories[key]}), key))[:10]
    assert len({v["slice"] for v in histories[changed_most[0]]}) > 2
    for key in changed_most:
        assert history.entity_history(pipeline.engine, DBID, *key) == histories[key], key
    # a history reads by the bucket each update carries, in order in every file
    for f in pipeline.engine.files("entity_updates"):
        rows = read_table(f, pipeline.engine.storage_options, [*core.ENTITY_KEY, "bucket"]).to_pylist()
        buckets = [r["bucket"] for r in rows]
        assert buckets == [core.bucket_of(*(r[c] for c in core.ENTITY_KEY)) for r in rows] == sorted(buckets)

    complete = {(r["clientid"], r["request"]): r for r in pipeline.read("complete_responses").to_pylist()}
    assert complete.keys() == model.requests.keys()
    for (clientid, request), row in complete.items():
        parts = [(r["part"], r["status"]) for r in json.loads(row["responses"])]
        expected = [(part, model.results[(clientid, request, part)]["status"])
                    for part in range(1, model.requests[(clientid, request)] + 1)]
        assert (row["parts"], parts) == (len(expected), expected), (clientid, request)
    assert pipeline.read("pending_responses").num_rows == 0

    # learned_schemas, merged task by task and slice by slice, equals one pass over the learned documents
    learned = {r["collection"]: Summary.from_json(r["summary"]) for r in pipeline.read("learned_schemas").to_pylist()}
    documents = {}
    for r in model.results.values():
        if r["learning"] and r["action"] in ("created", "updated"):
            documents.setdefault(r["collection"], []).append(r["after"])
    assert learned == {collection: Summary.of(docs) for collection, docs in documents.items()}

    # each committed row was published once
    for table, stream in (("entity_patches", "entity-patches"), ("entity_updates", "entity-updates"),
                          ("partial_responses", "partial-responses"), ("complete_responses", "complete-responses")):
        assert sum(pipeline.end_offsets(stream).values()) == pipeline.read(table).num_rows, stream


# --------------------------------------------------------------------------- subscriptions and inboxes

@dataclass
class SubscriptionTraffic:
    """Batches of `$zoneSubscription` patches and notification acks, from an admin client."""

    devices: int
    seed: int
    zones: tuple[str, ...] = ("default", "A", "B")
    _rng: random.Random = field(init=False)

    def __post_init__(self):
        self._rng = random.Random(self.seed)
        self.client = str(uuid.UUID(int=self.seed, version=4))
        self.request = 0
        self.made = 0
        self.live: set[str] = set()

    def subscription(self, i: int) -> dict:
        """A valid subscription document; every tenth one the docs' shape rejects."""
        rng = self._rng
        # half the time the device's own zone, so its subscriptions under other users overlap
        zone = self.zones[i % self.devices % len(self.zones)] if rng.random() < 0.5 else rng.choice(self.zones)
        doc = {"subjectZone": zone, "device": f"device-{i % self.devices:04d}",
               "user": f"user{i // self.devices}"}  # a device may be subscribed under several users
        if rng.random() < 0.7:
            doc["actions"] = sorted(rng.sample(ACTIONS, rng.randrange(1, 4)))
        if rng.random() < 0.3:
            doc["subjectCollection"] = rng.choice(("Contacts", "Groups"))
        self.made += 1
        if self.made % 20 == 0:
            del doc["device"]
        elif self.made % 10 == 0:
            doc["actions"] = []
        return doc

    def records(self, creations: int, changes: int) -> list[tuple[str, str, bytes]]:
        rng, patches = self._rng, []
        for _ in range(creations):
            i = rng.randrange(self.devices * 3)
            self.live.add(f"sub-{i}")
            patches.append((f"sub-{i}", [{"op": "add", "path": "", "value": self.subscription(i)}]))
        for entity in rng.sample(sorted(self.live), min(changes, len(self.live))):
            kind = rng.random()
            if kind < 0.3:
                self.live.discard(entity)
                ops = [{"op": "remove", "path": ""}]
            elif kind < 0.6:
                ops = [{"op": "replace", "path": "subjectZone", "value": rng.choice(self.zones)}]
            else:
                ops = [{"op": "add", "path": "actions", "value": sorted(rng.sample(ACTIONS, rng.randrange(1, 4)))}]
            patches.append((entity, ops))
        out = []
        for start in range(0, len(patches), 50):
            self.request += 1
            message = {"dbid": DBID, "clientid": self.client, "request": self.request, "user": "admin",
                       "begun": BEGUN + rng.randrange(0, 400_000), "includeBefore": True, "includeAfter": True,
                       "patches": [{"collection": SUBSCRIPTIONS, "zone": "default", "entity": entity, "ops": ops}
                                   for entity, ops in patches[start:start + 50]]}
            out.append(("entity-batches", samples.request_key(self.client, self.request), samples.encode(message)))
        return out

    def acks(self, pending: dict[str, set[str]]) -> list[tuple[str, str, bytes]]:
        """Acks for some devices: listed ids (with one nobody knows), everything, or nothing.

        `upTo` is all or nothing, so the model needs no notification's `ended` in advance.
        """
        rng, out = self._rng, []
        for device in sorted(pending):
            if rng.random() < 0.5:
                continue
            ack = {"dbid": DBID, "user": "user0", "device": device, "begun": BEGUN}
            kind = rng.random()
            if kind < 0.6:
                ids = sorted(pending[device])
                unknown = str(uuid.UUID(int=rng.getrandbits(128), version=4))  # seeded: a failing seed replays
                ack["notifications"] = rng.sample(ids, rng.randrange(0, len(ids) + 1)) + [unknown]
            elif kind < 0.85:
                ack["upTo"] = samples.ACK_ALL
            else:
                ack["upTo"] = 0  # nothing ended that early
            out.append(("notification-acks", device, samples.encode(ack)))
        return out


def notification_id(device, dbid, collection, zone, entity, clientid, request, part) -> str:
    return str(uuid.uuid5(NOTIFICATION_NAMESPACE, json.dumps([device, dbid, collection, zone, entity, clientid,
                                                              request, part])))


def subscription_of(doc) -> dict | None:
    """docs/streams.md's `$zoneSubscription` shape; anything else subscribes nobody."""
    if not isinstance(doc, dict) or not all(isinstance(doc.get(f), str) and doc[f]
                                            for f in ("subjectZone", "device", "user")):
        return None
    actions = doc.get("actions", list(ACTIONS))
    if not actions or not set(actions) <= set(ACTIONS):
        return None
    return {**doc, "actions": actions}


@dataclass
class Inboxes:
    """The fan-out and the inboxes as docs/streams.md states them, slice by slice."""

    pending: dict = field(default_factory=lambda: defaultdict(set))  # device -> unacknowledged notification ids
    shared: int = 0  # notifications of a device subscribed under several users
    malformed: int = 0  # subscriptions in effect that subscribe nobody

    def notifications(self, model: Model, updates: list[tuple]) -> dict[str, tuple]:
        """notification id -> (device, user, change key, action) for a slice's updates, given its end state."""
        docs = [doc for (collection, _, _), (_, doc) in model.state.items() if collection == SUBSCRIPTIONS and doc]
        by_zone = defaultdict(list)
        for sub in filter(None, map(subscription_of, docs)):
            by_zone[sub["subjectZone"]].append(sub)
        self.malformed += len(docs) - sum(map(len, by_zone.values()))
        out = {}
        for change in updates:
            clientid, request, part, collection, zone, entity = change
            if collection == SUBSCRIPTIONS:
                continue
            action = model.results[(clientid, request, part)]["action"]
            users = defaultdict(set)
            for s in by_zone[zone]:
                if s.get("subjectCollection") in (None, collection) and action in s["actions"]:
                    users[s["device"]].add(s["user"])
            for device, names in users.items():
                nid = notification_id(device, DBID, collection, zone, entity, clientid, request, part)
                out[nid] = (device, min(names), change, action)
                self.shared += len(names) > 1
        return out

    def ackable(self) -> dict[str, set[str]]:
        """Per device, the ids an app could acknowledge in a slice: those of earlier slices (a
        slice's own are published after it closed)."""
        return {device: set(inbox) for device, inbox in self.pending.items()}

    def apply(self, notes: dict[str, tuple], acks: list[tuple[str, str, bytes]]) -> set[str]:
        """The acks first, then the new notifications; the devices whose inbox changed."""
        changed = set()
        for _, device, value in acks:
            ack = json.loads(value)
            inbox = self.pending[device]
            gone = set(inbox) if ack.get("upTo") == samples.ACK_ALL else inbox & set(ack.get("notifications") or ())
            inbox -= gone
            if gone:
                changed.add(device)
        for nid, (device, *_rest) in notes.items():
            self.pending[device].add(nid)
            changed.add(device)
        return changed


@pytest.mark.parametrize(("batches", "devices", "zones", "slices", "production"), [
    pytest.param(600, 30, 3, 3, False, id="split-tasks"),
    pytest.param(60_000, 3_000, 1_000, 3, True, id="bench-sized", marks=pytest.mark.slow),
])
def test_zone_fan_out_and_inboxes_agree_with_a_model_of_the_subscriptions(make_pipeline, batches, devices, zones,
                                                                         slices, production):
    pipeline = make_pipeline(max_messages_per_task=max(200, batches // 8), production_layout=production)
    names = ("default", "A", "B", *(f"zone-{i}" for i in range(zones - 3)))
    traffic = MixedTraffic(entities=batches // 6, seed=7, zones=names)
    subs = SubscriptionTraffic(devices=devices, seed=11, zones=names)
    model, inboxes = Model(), Inboxes()
    expected_notes, expected_messages = {}, []
    for n in range(slices + 1):  # the last slice holds acks only: inboxes they clear stay empty
        records = [] if n == slices else subs.records(creations=devices if n == 0 else devices // 5, changes=devices // 4)
        records += [] if n == slices else traffic.records(batches // slices)
        seen = set(model.results)
        model.apply_slice(records)
        updates = sorted((*k, r["collection"], r["zone"], r["entity"]) for k, r in model.results.items()
                         if k not in seen and r["status"] == STATUS_OK)
        notes = inboxes.notifications(model, updates)
        acks = subs.acks(inboxes.ackable())
        changed = inboxes.apply(notes, acks)
        pipeline.produce(records + acks)
        [request] = pipeline.tick()
        assert pipeline.run_request(request).success
        expected_notes.update(notes)
        expected_messages.append((request.partition_key, {d: len(inboxes.pending[d]) for d in changed}))

    # the traffic reaches every rule: shared devices, cleared inboxes, each action notified
    assert inboxes.shared > 0 and inboxes.malformed > 0, (inboxes.shared, inboxes.malformed)
    assert Counter(action for *_, action in expected_notes.values()).keys() == set(ACTIONS)
    assert any(0 in counts.values() for _, counts in expected_messages)
    updates = {(r["clientid"], r["request"], r["part"]): r for r in pipeline.read("entity_updates").to_pylist()}
    # zone_changes: every update, subscriptions under the zone they subscribe to after the change,
    # else (deleted, or no longer a subscription) the zone they subscribed to before; a subscription
    # that moved, under both zones
    expected_zones = Counter()
    for k, result in model.results.items():
        if result["status"] != STATUS_OK:
            continue
        now, was = subscription_of(result["after"]), subscription_of(result["before"])
        if result["collection"] != SUBSCRIPTIONS or not (now or was):
            expected_zones[(k, result["zone"])] += 1
        else:
            expected_zones[(k, (now or was)["subjectZone"])] += 1
            if now and was and now["subjectZone"] != was["subjectZone"]:
                expected_zones[(k, was["subjectZone"])] += 1
    zone_changes = pipeline.read("zone_changes").to_pylist()
    assert Counter(((r["clientid"], r["request"], r["part"]), r["subjectZone"]) for r in zone_changes) == expected_zones
    assert any(n == 2 for n in Counter(k for k, _ in expected_zones.elements()).values())  # the traffic moves some

    # changes_by_device: one row per subscribed device per change, the lowest user, the change's action
    by_device = {r["notification"]: r for r in pipeline.read("changes_by_device").to_pylist()}
    assert by_device.keys() == expected_notes.keys()
    for nid, (device, user, (clientid, request, part, collection, zone, entity), action) in expected_notes.items():
        row = by_device[nid]
        assert (row["device"], row["user"], row["collection"], row["zone"], row["entity"], row["action"]) == (
            device, user, collection, zone, entity, action), nid
        assert row["ended"] == updates[(clientid, request, part)]["ended"]

    # device_notifications: per slice, one message per device whose inbox changed, with its count,
    # begun and ended the first and last unacknowledged notification's `ended`
    messages = pipeline.read("device_notifications").to_pylist()
    for key, counts in expected_messages:
        assert {r["device"]: r["count"] for r in messages if r["slice"] == key} == counts, key
    final = {}
    for r in sorted(messages, key=lambda r: r["slice"]):
        final[r["device"]] = r
    for device, row in final.items():
        ended = [by_device[n]["ended"] for n in inboxes.pending[device]]
        if ended:
            assert (row["count"], row["begun"], row["ended"]) == (len(ended), min(ended), max(ended)), device
        else:
            assert row["count"] == 0 and row["begun"] == row["ended"], device
    for table, stream in (("zone_changes", "zone-changes"), ("changes_by_device", "changes-by-device"),
                          ("device_notifications", "device-notifications")):
        assert sum(pipeline.end_offsets(stream).values()) == pipeline.read(table).num_rows, stream



# --------------------------------------------------------------------------- schema requests

@dataclass
class SchemaTraffic:
    """Schema requests of 1-3 parts over two databases; each part is its own schema-patches message."""

    seed: int
    dbids: tuple[str, ...] = ("db-a", "db-b")
    _rng: random.Random = field(init=False)

    def __post_init__(self):
        self._rng = random.Random(self.seed)
        self.client = str(uuid.UUID(int=self.seed, version=4))
        self.request = 0

    def requests(self, n: int) -> list[list[tuple[str, str, bytes]]]:
        """`n` requests, each as its parts' records in part order."""
        rng, out = self._rng, []
        for _ in range(n):
            self.request += 1
            dbid, parts, begun = rng.choice(self.dbids), rng.randrange(1, 4), BEGUN + rng.randrange(0, 100_000)
            out.append([("schema-patches", dbid, samples.encode({
                "dbid": dbid, "clientid": self.client, "request": self.request, "user": "admin", "begun": begun,
                "parts": parts, "part": part, "includeBefore": True, "includeAfter": True, "ops": self._ops()}))
                for part in range(1, parts + 1)])
        return out

    def _ops(self) -> list[dict]:
        rng = self._rng
        path = f"Type{rng.randrange(4)}/fields/f{rng.randrange(6)}"
        kind = rng.random()
        if kind < 0.45:
            return [{"op": "add", "path": path, "value": {"type": rng.choice(("STRING", "INTEGER")),
                                                          "optional": rng.random() < 0.5}}]
        if kind < 0.6:
            return [{"op": "replace", "path": f"{path}/optional", "value": True}]  # status 3 where it is missing
        if kind < 0.7:
            return [{"op": "remove", "path": path}]
        if kind < 0.8:
            return [{"op": "test", "path": f"{path}/type", "value": "STRING"},
                    {"op": "add", "path": f"{path}/tested", "value": True}]
        if kind < 0.9:
            return [{"op": "add", "path": path.split("/")[0], "value": {"fields": {}}}]  # a type emptied
        return [{"op": "add", "path": "Type9/fields/a", "value": {"type": "STRING"}},
                {"op": "move", "from": "/Type9", "path": "/Type8/fields/b"}]


@pytest.mark.parametrize(("requests_per_slice", "production"), [
    pytest.param(60, False, id="split-tasks"),
    pytest.param(3_000, True, id="bench-sized", marks=pytest.mark.slow),
])
def test_schema_requests_straddling_slices_agree_with_the_patch_engine(make_pipeline, requests_per_slice, production):
    pipeline = make_pipeline(max_messages_per_task=200, production_layout=production)
    rng, traffic = random.Random(5), SchemaTraffic(seed=13)
    schemas: dict = {}  # dbid -> (version, document)
    results: dict = {}  # (clientid, request, part) -> result
    parts_of: dict = {}  # (clientid, request) -> parts
    types: Counter = Counter()  # entity-type rows of schema_learning
    held: list = []  # parts sent in a later slice
    slices = 4
    for n in range(slices):
        records, held = held, []
        for request in traffic.requests(requests_per_slice):
            for record in request:  # parts of a request land in this slice or the next, in any order
                (held if n < slices - 1 and rng.random() < 0.3 else records).append(record)
        rng.shuffle(records)
        records += rng.sample(records, len(records) // 50)  # redelivered parts
        pipeline.produce(records)
        [run] = pipeline.tick()
        assert pipeline.run_request(run).success
        if n < slices - 1:  # parts wait for the rest of their request
            assert pipeline.read("pending_responses").num_rows > 0

        fresh = {}
        for _, _, value in records:
            m = json.loads(value)
            if (m["clientid"], m["request"], m["part"]) not in results:
                fresh[(m["begun"], m["clientid"], m["request"], m["part"])] = m
        for (_, clientid, request, part), m in sorted(fresh.items()):
            version, doc = schemas.get(m["dbid"], (0, {}))
            outcome = apply_patch(doc, m["ops"])
            ok = outcome.status == STATUS_OK
            results[(clientid, request, part)] = {"status": outcome.status, "error": outcome.error,
                                                  "before": doc if ok and version else None,  # none yet: null
                                                  "after": outcome.doc if ok else None}
            parts_of[(clientid, request)] = m["parts"]
            if ok:
                schemas[m["dbid"]] = (version + 1, outcome.doc)
                names = sorted(k for k, v in outcome.doc.items() if isinstance(v, dict))
                types.update((clientid, request, i, len(names), json.dumps({name: outcome.doc[name]}, sort_keys=True))
                             for i, name in enumerate(names, start=1))
    assert Counter(r["status"] for r in results.values()).keys() == {1, 3}

    updates = {(r["clientid"], r["request"], r["part"]): r for r in pipeline.read("schema_updates").to_pylist()}
    assert updates.keys() == results.keys()  # every schema patch, failed ones too (fold.SUCCESSES_ONLY)
    responses = {(r["clientid"], r["request"], r["part"]): r for r in pipeline.read("partial_responses").to_pylist()
                 if r["stream"] == "schema-updates"}
    assert responses.keys() == results.keys()
    for k, expected in results.items():
        for got in (responses[k], updates[k]):
            assert (got["status"], got["error"], _json(got["before"]), _json(got["after"])) == (
                expected["status"], expected["error"], expected["before"], expected["after"]), k
    stored = {r["dbid"]: (r["version"], _json(r["document"])) for r in pipeline.read("schemas").to_pylist()}
    assert stored == schemas

    complete = {(r["clientid"], r["request"]): [(x["part"], x["status"]) for x in json.loads(r["responses"])]
                for r in pipeline.read("complete_responses").to_pylist()}
    assert complete == {k: [(p, results[(*k, p)]["status"]) for p in range(1, parts + 1)]
                        for k, parts in parts_of.items()}
    assert pipeline.read("pending_responses").num_rows == 0

    learned = Counter((r["clientid"], r["request"], r["part"], r["parts"], json.dumps(json.loads(r["after"]),
                                                                                     sort_keys=True))
                      for r in pipeline.read("schema_learning").to_pylist() if r["kind"] == "entity-type")
    assert learned == types
