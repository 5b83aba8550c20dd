"""The pipeline against a model: random traffic through real slices, compared with the patch engine.

The entity core's tasks do not call `patch.apply_patch` one patch at a time: they validate ops in
bulk, fold each state bucket's keys in Arrow, split work over tasks and state files, and skip
redeliveries through the lake. This test feeds the same seeded traffic to the pipeline (real
broker, Spark, Delta, Dagster) and to a model written from docs/entity-core.md alone: dedupe on
(clientid, request, part), slices in order, within a slice each entity's patches in (begun,
clientid, request, part) order, each applied with the patch engine to the state left by the
previous. Every result must agree: statuses, errors, before/after, actions, versions, tombstones,
complete responses and the published topics.

The traffic mixes what production sees: creations, nested adds, appends, moves, copies, tests
that pass and fail, removes of missing paths (status 3), updates of entities that do not exist
(status 2), deletions and re-creations, multi-part batches, `begun` out of offset order, and
redeliveries within and across slices. The default size runs in the suite; the bench-sized one
(`-m slow`) runs production's task layout (large slices in Spark, the driver only for small ones).
"""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter
from dataclasses import dataclass, field

import pytest

from entity_assets import samples
from entity_assets.assets import common
from entity_assets.patch import STATUS_OK, apply_patch

PRODUCTION_LAYOUT = {"DRIVER_ROWS": common.DRIVER_ROWS, "SMALL_TASK_ROWS": common.SMALL_TASK_ROWS}
DBID = "my-db"
BEGUN = samples.SEED_ENTITY_BATCH["begun"]


@dataclass
class MixedTraffic:
    """Seeded batches whose patches succeed, fail (statuses 2 and 3), delete and re-create."""

    entities: int
    seed: int
    clients: int = 5
    redeliver: float = 0.02
    _rng: random.Random = field(init=False)

    def __post_init__(self):
        self._rng = random.Random(self.seed)
        rng = self._rng
        self.client_ids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(self.clients)]
        self.targets = [(("Contacts", "Groups")[i % 2], ("default", "A", "B")[i % 3],
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
                       "includeAfter": True, "patches": patches}
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
                pending.append(((batch["begun"], batch["clientid"], batch["request"], part), p))
        for (begun, clientid, request, part), p in sorted(pending, key=lambda item: item[0]):
            key = (p["collection"], p["zone"], p["entity"])
            version, doc = self.state.get(key, (0, None))
            outcome = apply_patch(doc, p["ops"])
            result = {"status": outcome.status, "error": outcome.error, "before": None, "after": None, "action": None}
            if outcome.status == STATUS_OK:
                action = "deleted" if outcome.deleted else "created" if doc is None else "updated"
                result.update(before=doc, after=outcome.doc, action=action)
                self.state[key] = (version + 1, outcome.doc)
            self.results[(clientid, request, part)] = result


def _json(text):
    return None if text is None else json.loads(text)


@pytest.mark.parametrize(("batches", "entities", "slices", "layout"), [
    pytest.param(900, 120, 3, None, id="split-tasks"),
    pytest.param(100_000, 10_000, 3, PRODUCTION_LAYOUT, id="bench-sized", marks=pytest.mark.slow),
])
def test_the_lake_agrees_with_the_patch_engine_in_slice_and_begun_order(make_pipeline, monkeypatch, batches,
                                                                      entities, slices, layout):
    for name, value in (layout or {}).items():
        monkeypatch.setattr(common, name, value)
    pipeline = make_pipeline(max_messages_per_task=max(200, batches // 8))
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

    complete = {(r["clientid"], r["request"]): r for r in pipeline.read("complete_responses").to_pylist()}
    assert complete.keys() == model.requests.keys()
    for (clientid, request), row in complete.items():
        parts = [(r["part"], r["status"]) for r in json.loads(row["responses"])]
        expected = [(part, model.results[(clientid, request, part)]["status"])
                    for part in range(1, model.requests[(clientid, request)] + 1)]
        assert (row["parts"], parts) == (len(expected), expected), (clientid, request)
    assert pipeline.read("pending_responses").num_rows == 0

    # each committed row was published once
    for table, stream in (("entity_patches", "entity-patches"), ("entity_updates", "entity-updates"),
                          ("partial_responses", "partial-responses"), ("complete_responses", "complete-responses")):
        assert sum(pipeline.end_offsets(stream).values()) == pipeline.read(table).num_rows, stream
