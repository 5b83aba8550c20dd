"""The entity core end to end: a real broker, real Spark, real Delta tables, Dagster through its public API.

entity-batches records -> slice -> entity_patches -> apply_patches (entity_updates, entities,
partial_responses, complete_responses, pending_responses) -> the derived topics, checked
against the seed's samples (docs/entity-core.md, docs/slices.md, docs/streams.md).

Runs are the expensive part, so each test closes as few slices as it can and checks
everything those slices show.
"""

from __future__ import annotations

import json
import os
import random
import string
import time
from collections import Counter

import pyarrow.compute as pc
import pytest
from confluent_kafka import Producer
from dagster import AssetCheckSeverity, AssetKey, DagsterEventType

from entity_assets import samples, trace
from entity_assets.assets import common, entities, retries
from entity_assets.publish import partition_for
from entity_assets.slices import slice_key
from entity_assets.storage import DeltaRsEngine
from entity_assets.tables import SCHEMAS
from resources import SparkResource

K1, K2 = slice_key(1), slice_key(2)
CLIENT = samples.SEED_CLIENT
SALLY = "400cb092-00af-4e44-bdcb-1a0c536692bf"
WILLIAM = "101c3c90-e304-4279-b6a0-020363c925c6"
GROUP = "6f1f1a52-3f0b-4c1e-9d6b-3d5a0c1f2e77"
BEGUN = samples.SEED_ENTITY_BATCH["begun"]

# --------------------------------------------------------------------------- the seed's samples

SALLY_OPS = [
    {"op": "add", "path": "firstName", "value": "Sally"},
    {"op": "add", "path": "lastName", "value": "Anderson"},
    {"op": "add", "path": "phone/home", "value": "1-222-555-1234"},
]
SALLY_AFTER = {"firstName": "Sally", "lastName": "Anderson", "phone": {"home": "1-222-555-1234"}}
WILLIAM_OPS = [
    {"op": "add", "path": "firstName", "value": "William"},
    {"op": "add", "path": "lastName", "value": "Johnson"},
    {"op": "add", "path": "homePhone", "value": "1-222-555-9876"},
]
WILLIAM_AFTER = {"firstName": "William", "lastName": "Johnson", "homePhone": "1-222-555-9876"}

# entity-patches sample
SEED_PATCH = {
    "db": "my-db", "collection": "Contacts", "zone": "default", "entity": SALLY, "clientid": CLIENT,
    "request": 2, "user": "jsmith", "begun": BEGUN, "part": 1, "parts": 1,
    "includeBefore": True, "includeAfter": True, "learning": True, "ops": SALLY_OPS,
}
# entity-updates sample, without `ended` (the record's Kafka timestamp here, not the sample's)
SEED_UPDATE = {
    "db": "my-db", "collection": "Contacts", "zone": "default", "entity": SALLY, "clientid": CLIENT,
    "request": 2, "user": "jsmith", "begun": BEGUN, "part": 1, "parts": 1, "ops": SALLY_OPS,
    "status": 1, "before": None, "after": SALLY_AFTER,
}
# complete-responses sample: its two partial responses, without `ended`
SEED_RESPONSES = [
    {"db": "my-db", "collection": "Contacts", "zone": "default", "entity": SALLY, "clientid": CLIENT, "request": 2,
     "user": "jsmith", "begun": BEGUN, "part": 1, "parts": 2, "ops": SALLY_OPS, "status": 1, "before": None,
     "after": SALLY_AFTER},
    {"db": "my-db", "collection": "Contacts", "zone": "default", "entity": WILLIAM, "clientid": CLIENT, "request": 2,
     "user": "jsmith", "begun": BEGUN, "part": 2, "parts": 2, "ops": WILLIAM_OPS, "status": 1, "before": None,
     "after": WILLIAM_AFTER},
]
# Fields the project adds to every output message (docs/streams.md: `dbid` beside the seed's `db`)
# and the seed's optional request flags, carried over when the request set them.
FLAGS = {"includeBefore": True, "includeAfter": True}

STATE_TABLES = ("entities", "schemas", "pending_responses", "learned_schemas", "devices", "device_inboxes")
STREAM_TABLES = tuple(sorted(t for t in SCHEMAS if t not in STATE_TABLES))


# --------------------------------------------------------------------------- helpers

def batch(request: int, patches: list[dict], *, begun: int, clientid: str = CLIENT, **flags) -> dict:
    return {"dbid": "my-db", "clientid": clientid, "request": request, "user": "jsmith", "begun": begun,
            "includeBefore": True, "includeAfter": True, **flags, "patches": patches}


def patch(entity: str, ops: list[dict], *, collection: str = "Contacts", zone: str = "default") -> dict:
    return {"collection": collection, "zone": zone, "entity": entity, "ops": ops}


def record(message: dict) -> tuple[str, str, bytes]:
    return ("entity-batches", samples.request_key(message["clientid"], message["request"]), samples.encode(message))


def rows(pipeline, table: str, **where) -> list[dict]:
    return [r for r in pipeline.read(table).to_pylist() if all(r[k] == v for k, v in where.items())]


def one(items: list):
    assert len(items) == 1, items
    return items[0]


def messages(pipeline, stream: str, **where) -> list[dict]:
    """The records on a derived topic, value decoded, filtered on message fields."""
    out = []
    for r in pipeline.consume(stream):
        value = json.loads(r["value"])
        if all(value.get(k) == v for k, v in where.items()):
            out.append({**r, "value": value})
    return out


def partitions_of(pipeline, stream: str) -> int:
    return len(pipeline.end_offsets(stream))


def ended_of(batch_row: dict) -> int:
    """The seed's `ended`, as docs/slices.md defines it: the source record's timestamp, or begun if later."""
    return max(batch_row["kafka_timestamp"], batch_row["begun"])


def canonical(table_rows: list[dict]) -> list[str]:
    """Rows as sortable text (None, bytes and nested values included), sorted."""
    return sorted(json.dumps(r, sort_keys=True, default=repr) for r in table_rows)


def slice_rows(pipeline, table: str, key: str) -> list[str]:
    data = pipeline.read(table)
    return canonical(data.filter(pc.equal(data["slice"], key)).to_pylist())


# --------------------------------------------------------------------------- 1 + 3: the seed's sample, statuses 2 and 3

def test_seed_batch_yields_the_seed_samples_and_failures_are_responses_only(pipeline):
    missing = "5c2a7d6e-0000-4000-8000-00000000beef"
    # begun in 2100, later than its record's timestamp: its `ended` is begun
    not_found = batch(21, [patch(missing, [{"op": "replace", "path": "firstName", "value": "Nobody"}])],
                      begun=4_102_444_800_000)
    # a valid op, then a failing one: all or nothing
    failing = batch(22, [patch(SALLY, [{"op": "replace", "path": "firstName", "value": "Sue"},
                                       {"op": "remove", "path": "nickname"}])], begun=BEGUN + 20)
    # deeper than any document may nest (and than Python's recursion limit): status 3, not a crash
    too_deep = batch(23, [patch(SALLY, [{"op": "add", "path": "/".join(["deep"] * 5000), "value": 1}])],
                     begun=BEGUN + 30)
    pipeline.produce([record(samples.SEED_ENTITY_BATCH), record(not_found), record(failing), record(too_deep)])
    [request] = pipeline.tick()
    result = pipeline.run_request(request)
    assert result.success

    source = one(rows(pipeline, "entity_batches", request=2))
    [on_kafka] = [r for r in pipeline.consume("entity-batches")
                  if r["key"] == samples.request_key(CLIENT, 2).encode()]
    assert source["kafka_timestamp"] == on_kafka["timestamp"] > 0
    ended = ended_of(source)

    # entity-patches: the seed's sample, field for field (plus the project's `dbid`)
    msg = one(messages(pipeline, "entity-patches", request=2))
    assert msg["key"] == SALLY.encode()
    assert msg["partition"] == partition_for(SALLY, partitions_of(pipeline, "entity-patches"))
    assert msg["value"] == {**SEED_PATCH, "dbid": "my-db"}

    # entity-updates: only the success, the seed's sample field for field; ended from the record
    update = one(messages(pipeline, "entity-updates"))
    assert update["key"] == SALLY.encode()
    assert update["partition"] == partition_for(SALLY, partitions_of(pipeline, "entity-updates"))
    value = update["value"]
    assert "ended" in value and value["ended"] == ended
    assert "before" in value and value["before"] is None  # created: null, present
    assert value == {**SEED_UPDATE, "dbid": "my-db", "learning": True, **FLAGS, "ended": ended}

    row = one(rows(pipeline, "entity_updates"))
    assert (row["clientid"], row["request"], row["user"], row["dbid"]) == (CLIENT, 2, "jsmith", "my-db")
    assert (row["collection"], row["zone"], row["entity"], row["part"], row["parts"]) == (
        "Contacts", "default", SALLY, 1, 1)
    assert row["begun"] == BEGUN and row["ended"] == ended and row["status"] == 1 and row["error"] is None
    assert json.loads(row["ops"]) == SALLY_OPS
    assert row["before"] is None and json.loads(row["after"]) == SALLY_AFTER
    assert row["learning"] and row["includeBefore"] and row["includeAfter"] and row["action"] == "created"
    assert row["slice"] == request.partition_key
    assert (row["kafka_topic"], row["kafka_partition"], row["kafka_offset"], row["kafka_timestamp"]) == (
        source["kafka_topic"], source["kafka_partition"], source["kafka_offset"], source["kafka_timestamp"])

    # statuses 2 and 3: partial responses with an error, never entity updates
    partials = {r["request"]: r for r in rows(pipeline, "partial_responses")}
    assert sorted(partials) == [2, 21, 22, 23]
    assert partials[2]["status"] == 1 and partials[2]["error"] is None
    assert partials[21]["status"] == 2 and partials[21]["error"]
    assert partials[22]["status"] == 3 and "op 1 (remove" in partials[22]["error"]
    assert partials[23]["status"] == 3 and "deeper than 100 levels" in partials[23]["error"]
    for r in (partials[21], partials[22], partials[23]):
        assert r["before"] is None and r["after"] is None and r["stream"] == "entity-updates"
        assert r["ended"] == ended_of(one(rows(pipeline, "entity_batches", request=r["request"])))
    assert partials[21]["ended"] == not_found["begun"] > partials[22]["ended"]
    on_topic = {m["value"]["request"]: m["value"] for m in messages(pipeline, "partial-responses")}
    assert on_topic[2] == value
    for n, status in ((21, 2), (22, 3)):
        assert on_topic[n]["status"] == status and on_topic[n]["error"] == partials[n]["error"]
        assert "before" not in on_topic[n] and "after" not in on_topic[n]
    assert [r["request"] for r in rows(pipeline, "entity_updates")] == [2]

    # all or nothing: Sally is as the seed's patch left her; the missing entity stays missing
    sally = one(rows(pipeline, "entities"))
    assert sally["entity"] == SALLY and sally["version"] == 1 and not sally["deleted"]
    assert json.loads(sally["document"]) == SALLY_AFTER and sally["ended"] == ended

    # every single-part request completes, whatever its status
    completes = {r["request"]: r for r in rows(pipeline, "complete_responses")}
    assert sorted(completes) == [2, 21, 22, 23]
    assert [r["status"] for r in json.loads(completes[22]["responses"])] == [3]

    meta = pipeline.materializations(result)
    assert meta["partial_responses"]["entity-updates status 1"] == 1
    assert meta["partial_responses"]["entity-updates status 2"] == 1
    assert meta["partial_responses"]["entity-updates status 3"] == 2
    assert meta["partial_responses"]["schema-updates status 1"] == 0  # every status at every slice: plots without gaps
    assert meta["partial_responses"]["rows"] == 4 and meta["partial_responses"]["pending_parts"] == 0
    assert meta["entity_updates"]["rows"] == 1 and meta["entity_patches"]["duplicates"] == 0
    # the UI's row counts: a stream's of the slice, a state table's whole (Sally, as of this slice)
    assert meta["entity_updates"]["dagster/partition_row_count"] == 1 and meta["entities"]["dagster/row_count"] == 1
    header, _, preview = meta["entity_updates"]["preview"].splitlines()  # a markdown table of the update
    assert header == "| entity | collection | zone | part | action | ops | after |"
    assert preview.startswith(f"| `{SALLY}` | `Contacts` | `default` | `1` | `created` | `[") and '"firstName"' in preview
    checks = pipeline.checks(result)
    for name in ("updates_are_successes", "responses_have_every_part", "one_row_per_entity"):
        assert checks[name].passed is True, (name, checks)
    assert meta["entity_updates"]["published"] == 1 and meta["partial_responses"]["published"] == 4
    assert pipeline.observations(result)["kafka/entity-patches"]["messages"] == 4  # by apply_patches, in fold order
    assert not os.listdir(pipeline.engine.uri(common.OUTBOX_FOLDER))  # published spools are deleted


STEP_STREAMS = {
    "apply_patches": {"entity-patches": "entity_patches", "entity-updates": "entity_updates",
                      "schema-updates": "schema_updates", "schema-learning": "schema_learning",
                      "partial-responses": "partial_responses", "complete-responses": "complete_responses"},
    "zone_changes": {"zone-changes": "zone_changes"},
    "device_notifications": {"changes-by-device": "changes_by_device", "device-notifications": "device_notifications"},
}
"""The streams each publishing step sends, and their tables."""


@pytest.mark.parametrize(("table", "step", "driver_rows"), [
    ("entities", "apply_patches", 0), ("complete_responses", "apply_patches", 10_000),
    ("zone_changes", "zone_changes", 0), ("device_notifications", "device_notifications", 10_000)])
def test_messages_go_out_only_once_their_rows_are_committed(make_pipeline, monkeypatch, table, step, driver_rows):
    """A step whose commit fails publishes nothing, whichever of its commits fails, from spool files
    (Spark tasks) or from memory (tasks in the driver); its re-run publishes every message once."""
    pipeline = make_pipeline(driver_rows=driver_rows)
    first, _ = slice_records()
    pipeline.produce(first)
    [request] = pipeline.tick()
    with monkeypatch.context() as patched:
        refuse_commits(patched, table, "the lake refused the commit")
        failed = pipeline.run_request(request, raise_on_error=False)
    [failure] = [e for e in failed.all_events if e.is_step_failure]
    assert failure.step_key == step and "the lake refused the commit" in pipeline.failure_text(failure)
    streams = STEP_STREAMS[step]
    assert not any(messages(pipeline, stream) for stream in streams)
    assert pipeline.run_request(request).success
    on_topics = {stream: len(messages(pipeline, stream)) for stream in streams}
    assert on_topics == {stream: len(rows(pipeline, t)) for stream, t in streams.items()} and all(on_topics.values())


def refuse_commits(patched: pytest.MonkeyPatch, table: str = "entities", error: str = "the store went away") -> None:
    """Makes the lake refuse a table's commits (the entities state's by default), as a store that went away would."""
    commit = DeltaRsEngine.commit

    def failing(self, name, *args, **kwargs):
        if name == table:
            raise OSError(error)
        return commit(self, name, *args, **kwargs)

    patched.setattr(DeltaRsEngine, "commit", failing)


def two_slices_requested(pipeline) -> tuple[list, object, object]:
    """`slice_records()`'s first slice's records, and the run requests of its two slices."""
    first, second = slice_records()
    pipeline.produce(first)
    [r1] = pipeline.tick()
    pipeline.produce(second)
    [r2] = pipeline.tick()
    return first, r1, r2


def test_a_step_that_fails_transiently_is_retried_within_its_run(pipeline, monkeypatch):
    """An object store's blip costs a retry of the step, not a failed run that every later slice
    would wait on (refused as out of order) until someone re-ran it. A failure that is no blip (a
    bug, a refusal) fails the run at once, and a retry publishes each message once."""
    monkeypatch.setenv(retries.RETRIES_VARIABLE, "2")
    monkeypatch.setattr(retries, "RETRY_DELAY_SECONDS", 0)
    first, r1, r2 = two_slices_requested(pipeline)
    commit = DeltaRsEngine.commit

    def failing(error: Exception, times: int):
        def commit_or_fail(self, name, *args, **kwargs):
            if name == "entities" and len(raised) < times:
                raised.append(name)
                raise error
            return commit(self, name, *args, **kwargs)
        return commit_or_fail

    def retried(result) -> list[str]:
        return [e.step_key for e in result.all_events if e.event_type == DagsterEventType.STEP_UP_FOR_RETRY]

    # the second slice first: refused, not retried
    refused = pipeline.run_request(r2, raise_on_error=False)
    assert not refused.success and retried(refused) == []
    # a bug: not retried
    raised: list[str] = []
    with monkeypatch.context() as patched:
        patched.setattr(DeltaRsEngine, "commit", failing(ValueError("a bug"), 1))
        broken = pipeline.run_request(r1, raise_on_error=False)
    assert not broken.success and raised and retried(broken) == []
    # the store goes away for a moment: the step again, in the same run
    raised = []
    with monkeypatch.context() as patched:
        patched.setattr(DeltaRsEngine, "commit", failing(OSError("the store went away for a moment"), 1))
        result = pipeline.run_request(r1)
    assert result.success and raised and retried(result) == ["apply_patches"]
    assert pipeline.run_request(r2).success
    streams = STEP_STREAMS["apply_patches"]
    on_topics = {stream: len(messages(pipeline, stream)) for stream in streams}
    assert on_topics == {stream: len(rows(pipeline, t)) for stream, t in streams.items()} and all(on_topics.values())
    # a store that stays away: the retries, then the run fails, naming the cause
    pipeline.produce(first[:1])
    [r3] = pipeline.tick()
    raised = []
    with monkeypatch.context() as patched:
        patched.setattr(DeltaRsEngine, "commit", failing(OSError("the store is gone"), 99))
        gone = pipeline.run_request(r3, raise_on_error=False)
    assert not gone.success and retried(gone) == ["apply_patches"] * 2 and len(raised) == 3
    [failure] = [e for e in gone.all_events if e.is_step_failure]
    assert "the store is gone" in pipeline.failure_text(failure)  # the error itself, not Dagster's retry count


def test_slices_that_failed_behind_a_failed_slice_are_asked_for_again_once_it_is_done(pipeline, monkeypatch):
    """A slice that failed (the lake refused its commit past the retries) fails the later slices'
    runs as out of order; once it is run again by hand, the next tick asks for them again, once:
    a slice whose run fails after the slice before it is done fails on its own."""
    _, r1, r2 = two_slices_requested(pipeline)

    with monkeypatch.context() as patched:
        refuse_commits(patched)
        assert not pipeline.run_request(r1, raise_on_error=False).success
    assert not pipeline.run_request(r2, raise_on_error=False).success  # refused: slice 1 is missing
    assert pipeline.tick() == []  # still missing: nothing to ask for
    assert pipeline.run_request(r1).success  # run again by hand
    [again] = pipeline.tick()
    assert again.partition_key == K2 and again.run_key != r2.run_key
    with monkeypatch.context() as patched:  # fails now on its own: not asked for again
        refuse_commits(patched)
        assert not pipeline.run_request(again, raise_on_error=False).success
    assert pipeline.tick() == []
    # nor once slice 1 is looked into since (a replay of one of its assets, from the UI)
    assert pipeline.run(K1, assets=pipeline.asset_keys_of("learned_schemas")).success
    assert pipeline.tick() == []
    assert pipeline.run_request(again).success
    assert pipeline.tick() == []
    assert {r["slice"] for r in rows(pipeline, "entity_updates")} == {K1, K2}


def test_slices_cancelled_behind_a_failed_slice_are_asked_for_again_once_its_failed_steps_ran_again(
        pipeline, monkeypatch):
    """Whoever stops the queue behind a failed slice (cancelling the later slices' runs), then runs
    again only the failed slice's steps that failed (the UI's From failure), gets the cancelled
    slices asked for again too."""
    from dagster import DagsterRun, DagsterRunStatus

    from entity_assets.sensors import PARTITION_TAG

    _, r1, _ = two_slices_requested(pipeline)

    with monkeypatch.context() as patched:
        refuse_commits(patched)
        assert not pipeline.run_request(r1, raise_on_error=False).success
    pipeline.instance.add_run(DagsterRun(job_name="slice_job", run_id="00000000-0000-4000-8000-000000000002",
                                         status=DagsterRunStatus.CANCELED, tags={PARTITION_TAG: K2}))
    assert pipeline.tick() == []
    failed_steps = [*pipeline.asset_keys_of("entities"), "learned_schemas", "zone_changes", "changes_by_device",
                    "device_notifications"]
    assert pipeline.run(K1, assets=failed_steps).success
    [again] = pipeline.tick()
    assert again.partition_key == K2 and pipeline.run_request(again).success
    assert pipeline.tick() == []


def test_a_slice_that_failed_to_publish_holds_back_the_next_until_it_is_run_again(pipeline, monkeypatch):
    """A step commits, then publishes: with the broker down, slice 1 is applied but its messages
    are not out, and slice 2, queued already, would put the entity's next patch on Kafka first."""
    sally = samples.SEED_ENTITY_BATCH["patches"][0]
    later = batch(7, [patch(SALLY, [{"op": "replace", "path": "firstName", "value": "Sal"}],
                            collection=sally["collection"], zone=sally["zone"])], begun=1415747090000)
    pipeline.produce([record(samples.SEED_ENTITY_BATCH)])
    [r1] = pipeline.tick()
    pipeline.produce([record(later)])
    [r2] = pipeline.tick()

    def broker_down(spark, files, publish_to):
        raise RuntimeError("the broker is down")

    with monkeypatch.context() as down:
        down.setattr(entities, "publish_outbox", broker_down)
        assert not pipeline.run_request(r1, raise_on_error=False).success  # applied, not published
    refused = pipeline.run_request(r2, raise_on_error=False)
    [failure] = [e for e in refused.all_events if e.is_step_failure]
    assert failure.step_key == "apply_patches"
    assert f"the entity_updates messages of slice {K1} are not published" in pipeline.failure_text(failure)
    assert not messages(pipeline, "entity-patches")

    assert pipeline.run_request(r1).success and pipeline.run_request(r2).success
    assert [m["value"]["request"] for m in messages(pipeline, "entity-patches")] == [2, 7]  # one key: one partition

    # the last step fails to publish after every state applied slice 3: slice 4's run, refused,
    # is held back, and asked for again once slice 3 is run again (not when its state applied)
    publish = common.publish_outbox

    def notifications_down(spark, files, publish_to):
        if publish_to is not None and "device_notifications" in publish_to.topics:
            raise RuntimeError("the broker is down")
        return publish(spark, files, publish_to)

    pipeline.produce([record(batch(8, [patch(SALLY, [{"op": "add", "path": "n", "value": 8}])], begun=BEGUN + 8))])
    [r3] = pipeline.tick()
    pipeline.produce([record(batch(9, [patch(SALLY, [{"op": "add", "path": "n", "value": 9}])], begun=BEGUN + 9))])
    [r4] = pipeline.tick()
    with monkeypatch.context() as down:
        down.setattr(common, "publish_outbox", notifications_down)
        assert not pipeline.run_request(r3, raise_on_error=False).success
    assert not pipeline.run_request(r4, raise_on_error=False).success  # refused: slice 3 is not published
    assert pipeline.tick() == []
    assert pipeline.run_request(r3).success
    [again] = pipeline.tick()
    assert again.partition_key == slice_key(4) and pipeline.run_request(again).success


def test_a_message_too_large_for_its_topic_stays_in_the_lake_and_the_slices_go_on(pipeline):
    """The broker refuses a message over its topic's max.message.bytes, which used to fail the step
    at every run of the slice and hold back the slices after it. Such a message is not sent: its
    row is committed, and a warning counts and names it."""
    from entity_assets.kafka_io import BATCH_FRAMING, ensure_topics

    updates, zones = pipeline.topic("entity-updates"), pipeline.topic("zone-changes")
    ensure_topics(pipeline.kafka.config(), [updates, zones], pipeline.kafka.new_topic_partitions,
                  topic_configs={topic: {"max.message.bytes": "3000"} for topic in (updates, zones)})
    noise = "".join(random.Random(1).choices(string.ascii_letters + string.digits, k=5000))  # zstd cannot shrink
    big = [{"op": "add", "path": "notes", "value": noise}]  # it below 3000 bytes: the broker would refuse it
    plain = [{"op": "add", "path": "notes", "value": "x" * 5000}]  # zstd makes it a few hundred bytes: it goes
    pipeline.produce([record(batch(2, [patch(SALLY, SALLY_OPS), patch(WILLIAM, big), patch(GROUP, plain)],
                                   begun=BEGUN))])
    [r1] = pipeline.tick()
    result = pipeline.run_request(r1)
    assert {r["entity"] for r in rows(pipeline, "entity_updates")} == {SALLY, WILLIAM, GROUP}
    assert sorted(m["value"]["entity"] for m in messages(pipeline, "entity-updates")) == sorted([SALLY, GROUP])
    assert {m["value"]["entity"] for m in messages(pipeline, "entity-patches")} == {SALLY, WILLIAM, GROUP}  # 1 MB
    [check] = [e for e in result.get_asset_check_evaluations()
               if e.check_name == "messages_fit_their_topics" and e.asset_key.to_user_string() == "entity_updates"]
    assert check.passed is False and check.severity == AssetCheckSeverity.WARN
    assert check.metadata["by_stream"].value == {"entity-updates": 1}
    [named] = check.metadata["first"].value
    assert named["stream"] == "entity-updates" and named["key"] == WILLIAM and named["limit"] == 3000 - BATCH_FRAMING
    assert named["bytes"] > 10_000 and named["compressed"] > 3000  # the ops and the after
    assert pipeline.materializations(result)["entity_updates"]["published"] == 2
    # zone_changes, a later step, leaves it out the same way, with its own check
    assert sorted(m["value"]["entity"] for m in messages(pipeline, "zone-changes")) == sorted([SALLY, GROUP])
    [check] = [e for e in result.get_asset_check_evaluations()
               if e.check_name == "messages_fit_their_topics" and e.asset_key.to_user_string() == "zone_changes"]
    assert check.passed is False and check.metadata["by_stream"].value == {"zone-changes": 1}

    pipeline.produce([record(batch(3, [patch(SALLY, [{"op": "replace", "path": "firstName", "value": "Sal"}])],
                                   begun=BEGUN + 1))])
    [r2] = pipeline.tick()
    assert all(e.passed for e in pipeline.run_request(r2).get_asset_check_evaluations()
               if e.check_name == "messages_fit_their_topics")
    assert [m["value"]["request"] for m in messages(pipeline, "entity-updates", entity=SALLY)] == [2, 3]
    # run again untagged, slice 1 publishes nothing: a bare pass would read as its message delivered
    again = pipeline.run_request(r1)
    said = [e for e in again.get_asset_check_evaluations() if e.check_name == "messages_fit_their_topics"]
    assert said and all(e.metadata["published"].value is False and "published none" in e.description
                        for e in said)


def test_only_the_streams_named_are_published_and_every_table_is_written(make_pipeline):
    """`KafkaResource.published_streams`: what client drivers follow goes out; the rest stays in the lake."""
    pipeline = make_pipeline(published_streams=["partial-responses", "complete-responses"])
    pipeline.produce([record(samples.SEED_ENTITY_BATCH)])
    [request] = pipeline.tick()
    result = pipeline.run_request(request)
    meta = pipeline.materializations(result)

    assert one(rows(pipeline, "entity_patches"))["entity"] == SALLY
    assert one(rows(pipeline, "entity_updates"))["entity"] == SALLY
    assert one(messages(pipeline, "partial-responses"))["value"]["entity"] == SALLY
    assert one(messages(pipeline, "complete-responses"))["value"]["request"] == 2
    assert not messages(pipeline, "entity-patches") and not messages(pipeline, "entity-updates")
    observed = pipeline.observations(result)  # the topics published to, each with the slice's messages
    assert {k: v["messages"] for k, v in observed.items()} == {"kafka/partial-responses": 1,
                                                                "kafka/complete-responses": 1}
    assert [meta[t]["published"] for t in ("entity_updates", "partial_responses",
                                           "complete_responses")] == [0, 1, 1]
    assert not os.listdir(pipeline.engine.uri(common.OUTBOX_FOLDER))


# --------------------------------------------------------------------------- 2: the seed's two-part complete response

def test_two_part_batch_yields_the_seed_complete_response(pipeline):
    two_part = {**samples.SEED_ENTITY_BATCH, "learning": False,
                "patches": [patch(SALLY, SALLY_OPS), patch(WILLIAM, WILLIAM_OPS)]}
    pipeline.produce([record(two_part)])
    [request] = pipeline.tick()
    result = pipeline.run_request(request)
    assert result.success
    ended = ended_of(one(rows(pipeline, "entity_batches")))

    expected = [{**r, "dbid": "my-db", **FLAGS, "ended": ended} for r in SEED_RESPONSES]
    request_id = samples.request_key(CLIENT, 2).encode()

    partials = messages(pipeline, "partial-responses")
    n_partial = partitions_of(pipeline, "partial-responses")
    assert sorted((m["value"] for m in partials), key=lambda v: v["part"]) == expected
    for m in partials:
        assert m["key"] == request_id and m["partition"] == partition_for(CLIENT, n_partial)

    row = one(rows(pipeline, "complete_responses"))
    assert (row["clientid"], row["request"], row["user"], row["dbid"]) == (CLIENT, 2, "jsmith", "my-db")
    assert row["parts"] == 2 and row["begun"] == BEGUN and row["ended"] == ended
    assert json.loads(row["responses"]) == expected  # the partial responses, ordered by part

    complete = one(messages(pipeline, "complete-responses"))
    assert complete["key"] == request_id
    assert complete["partition"] == partition_for(CLIENT, partitions_of(pipeline, "complete-responses"))
    assert complete["value"] == {"clientid": CLIENT, "request": 2, "user": "jsmith", "begun": BEGUN, "parts": 2,
                                 "ended": ended, "responses": expected}

    assert {r["entity"]: r["version"] for r in rows(pipeline, "entities")} == {SALLY: 1, WILLIAM: 1}
    assert sorted((r["part"], r["entity"]) for r in rows(pipeline, "entity_patches")) == [(1, SALLY), (2, WILLIAM)]
    assert all(r["parts"] == 2 for r in rows(pipeline, "entity_patches"))
    checks = pipeline.checks(result)
    assert checks["responses_have_every_part"].passed is True, checks


# --------------------------------------------------------------------------- 9: order within a slice

def test_an_entitys_patches_apply_in_begun_order_not_offset_order(pipeline):
    entity = "0d7e3f4a-1111-4000-8000-000000000009"
    low, high = "00000000-0000-4000-8000-00000000000a", "ffffffff-0000-4000-8000-00000000000f"

    def step(clientid, request, begun, expect, ops):
        test = [] if expect is None else [{"op": "test", "path": "name", "value": expect}]
        return batch(request, [patch(entity, test + ops)], begun=begun, clientid=clientid, includeBefore=False)

    # (begun, clientid, request) order: create, second, third, last; each `test`s its predecessor's
    # result, so any other order fails with status 2 or 3.
    create = step(high, 1, 1000, None, [{"op": "add", "path": "name", "value": "first"}])
    second = step(low, 1, 2000, "first", [{"op": "replace", "path": "name", "value": "second"}])
    third = step(low, 2, 2000, "second", [{"op": "replace", "path": "name", "value": "third"}])
    last = step(high, 2, 2000, "third", [{"op": "add", "path": "done", "value": True}])
    # Produced in the reverse order, with explicit partitions: `last` and `create` share partition 0
    # with `last` at the lower offset; `third` and `second` on partitions 1 and 2.
    placed = ((last, 0), (third, 1), (second, 2), (create, 0))
    producer = Producer(pipeline.kafka.config())
    topic = pipeline.topic("entity-batches")
    for message, partition in placed:
        key = samples.request_key(message["clientid"], message["request"])
        producer.produce(topic, key=key, value=samples.encode(message), partition=partition)
        assert producer.flush(30) == 0
        time.sleep(0.005)  # Kafka timestamps increase too: the reverse of begun order

    [request] = pipeline.tick()
    result = pipeline.run_request(request)
    assert result.success

    coords = {(r["clientid"], r["request"]): (r["kafka_partition"], r["kafka_offset"], r["kafka_timestamp"])
              for r in rows(pipeline, "entity_batches")}
    assert {k: c[:2] for k, c in coords.items()} == {(high, 2): (0, 0), (low, 2): (1, 0), (low, 1): (2, 0),
                                                      (high, 1): (0, 1)}
    assert coords[(high, 2)][2] <= coords[(low, 2)][2] <= coords[(low, 1)][2] <= coords[(high, 1)][2]

    state = one(rows(pipeline, "entities"))
    assert json.loads(state["document"]) == {"name": "third", "done": True}
    assert state["version"] == 4
    assert [r["status"] for r in rows(pipeline, "partial_responses")] == [1, 1, 1, 1]
    updates = sorted(rows(pipeline, "entity_updates"), key=lambda r: (r["begun"], r["clientid"], r["request"]))
    assert [(r["clientid"], r["request"]) for r in updates] == [(high, 1), (low, 1), (low, 2), (high, 2)]
    assert [json.loads(r["after"]) for r in updates] == [
        {"name": "first"}, {"name": "second"}, {"name": "third"}, {"name": "third", "done": True}]
    assert [r["action"] for r in updates] == ["created", "updated", "updated", "updated"]
    # the entity's last change is the last patch in (begun, ...) order, not the last record produced
    assert state["ended"] == one([r for r in updates if r["clientid"] == high and r["request"] == 2])["ended"]
    # its patches (read by tasks of different input files) and its updates reach Kafka in that order too
    for stream in ("entity-patches", "entity-updates"):
        assert [(m["value"]["clientid"], m["value"]["request"]) for m in messages(pipeline, stream)] == [
            (high, 1), (low, 1), (low, 2), (high, 2)], stream


@pytest.mark.parametrize("driver_rows", [0, SparkResource().driver_rows], ids=["spark-tasks", "driver"])
def test_the_parts_of_a_request_reach_kafka_in_part_order(make_pipeline, driver_rows):
    """A request's parts are patches of entities in different buckets, so different fold tasks:
    complete_task, which groups them, publishes their partial responses in part order, from
    spool files (Spark tasks) and from memory (tasks in the driver, as a small slice's run)."""
    pipeline = make_pipeline(driver_rows=driver_rows)
    requests = [batch(40 + r, [patch(f"multi-{r}-{p}", [{"op": "add", "path": "n", "value": p}]) for p in range(4)],
                      begun=BEGUN + r) for r in range(12)]
    pipeline.produce([record(b) for b in requests])
    [request] = pipeline.tick()
    assert pipeline.run_request(request).success
    parts: dict[int, list[int]] = {}
    for m in messages(pipeline, "partial-responses"):
        parts.setdefault(m["value"]["request"], []).append(m["value"]["part"])
    assert parts == {40 + r: [1, 2, 3, 4] for r in range(12)}
    assert len(rows(pipeline, "partial_responses")) == 48 and len(messages(pipeline, "complete-responses")) == 12


def test_a_request_whose_last_part_never_comes_expires_after_its_wait(make_pipeline):
    """A client that died between the parts of a schema request (one message a part): its part
    waits `parts_wait_slices` slices in pending_responses, then leaves it, named by a WARN check."""
    pipeline = make_pipeline(parts_wait_slices=1)
    part1 = {**samples.SEED_SCHEMA_PATCH, "request": 21, "parts": 2, "part": 1}
    pipeline.produce([("schema-patches", "my-db", samples.encode(part1))])
    [r1] = pipeline.tick()
    first = pipeline.run_request(r1)
    assert first.success and pipeline.checks(first)["no_request_expired"].passed
    assert one(rows(pipeline, "pending_responses"))["request"] == 21
    pipeline.produce([record(samples.SEED_ENTITY_BATCH)])
    [r2] = pipeline.tick()
    second = pipeline.run_request(r2)
    assert second.success
    assert not rows(pipeline, "pending_responses") and not rows(pipeline, "complete_responses", request=21)
    check = pipeline.checks(second)["no_request_expired"]
    assert not check.passed and check.metadata["expired"].value == 1
    assert check.metadata["first"].value == [f"{part1['clientid']}/21: parts [1] of 2, the first in slice {K1}"]
    assert one(rows(pipeline, "partial_responses", request=21))["part"] == 1  # its result went out


def test_a_slice_run_again_after_a_later_one_publishes_only_when_told(pipeline):
    """Slice 1's messages carry older values of the keys slice 2 updated: published again, they
    would be the last word for consumers, and for compaction, which keeps a key's last message."""
    keys = []
    for r in range(3):
        pipeline.produce([record(batch(80 + r, [patch("again", [{"op": "add", "path": "n", "value": r}])],
                                       begun=BEGUN + r))])
        [request] = pipeline.tick()
        keys.append(request.partition_key)
    k1, k2, k3 = keys
    for key in (k1, k2):
        assert pipeline.run(key).success
    streams = ("entity-updates", "zone-changes", "partial-responses")
    counts = {s: len(messages(pipeline, s)) for s in streams}
    again = pipeline.run(k1)
    assert again.success and {s: len(messages(pipeline, s)) for s in streams} == counts
    assert pipeline.materializations(again)["entity_updates"]["published"] == 0
    assert any(f"slice {k1} publishes nothing: slice {k2} has published" in entry.user_message
               for entry in pipeline.instance.all_logs(again.run_id))
    first_run = [r["value"] for r in pipeline.consume("entity-updates")]
    told = pipeline.run(k1, tags={common.REPUBLISH_TAG: "true"})
    assert told.success and {s: len(messages(pipeline, s)) for s in streams} == {s: n + 1 for s, n in counts.items()}
    # the same message, byte for byte (outputs are deterministic: no wall-clock time)
    assert [r["value"] for r in pipeline.consume("entity-updates")] == first_run + first_run[:1]
    # the UI's re-execution keeps its parent's tags: the tag was given before slices since published
    reexecuted = pipeline.run(k1, tags={common.REPUBLISH_TAG: "true", "dagster/parent_run_id": told.run_id})
    assert reexecuted.success and len(messages(pipeline, "entity-updates")) == counts["entity-updates"] + 1
    assert any(f"this run re-executes run {told.run_id}" in entry.user_message
               for entry in pipeline.instance.all_logs(reexecuted.run_id))
    # the newest slice run again publishes nothing once its publish is recorded (a step retried
    # after it, say), or again when told; the next slice follows it
    assert pipeline.run(k2).success and len(messages(pipeline, "entity-updates")) == counts["entity-updates"] + 1
    assert pipeline.run(k2, tags={common.REPUBLISH_TAG: "true"}).success
    assert len(messages(pipeline, "entity-updates")) == counts["entity-updates"] + 2
    assert pipeline.run(k3).success
    assert [m["value"]["after"]["n"] for m in messages(pipeline, "entity-updates")][-1] == 2


def test_a_redelivery_is_found_up_to_the_edge_of_the_dedupe_window_and_not_past_it(make_pipeline):
    pipeline = make_pipeline(dedupe_window_slices=2)

    def request(number: int):
        return record(batch(number, [patch(f"edge-{number}", [{"op": "add", "path": "n", "value": number}])],
                            begun=BEGUN + number))

    # slice 3 looks back at slices 1 and 2, slice 4 at slices 2 and 3
    for records in ([request(100), request(101)], [request(102)], [request(101), request(103)], [request(100)]):
        pipeline.produce(records)
        [slice_run] = pipeline.tick()
        assert pipeline.run_request(slice_run).success
    assert [r["slice"] for r in rows(pipeline, "entity_patches", request=101)] == [K1]
    assert sorted(r["slice"] for r in rows(pipeline, "entity_patches", request=100)) == [K1, slice_key(4)]


def test_a_slice_run_again_keeps_the_dedupe_window_of_its_first_run(make_pipeline):
    """The state holds what the first run's window applied: a re-run after dedupe_window_slices
    changed would explode a redelivery that the state never applied."""
    first = make_pipeline()
    redelivered = record(batch(90, [patch("window", [{"op": "add", "path": "n", "value": 1}])], begun=BEGUN))
    keys = []
    for _ in range(2):
        first.produce([redelivered])
        [request] = first.tick()
        keys.append(request.partition_key)
        assert first.run(request.partition_key).success
    assert len(rows(first, "entity_patches", request=90)) == 1
    narrower = make_pipeline(prefix=first.prefix, lake_root=first.lake.root, instance=first.instance,
                             dedupe_window_slices=0)
    again = narrower.run(keys[1])
    assert again.success and narrower.materializations(again)["entity_patches"]["duplicates"] == 1
    assert len(rows(first, "entity_patches", request=90)) == 1 and not rows(first, "entity_updates", slice=keys[1])


def test_the_schema_patches_of_a_slice_take_the_dedupe_window_its_entity_patches_took(tmp_path):
    """apply_patches' first run re-executed after the setting changed: its schema redeliveries
    must be found as its entity ones were (and as every replay finds them)."""
    import logging
    from types import SimpleNamespace

    from resources import SlicingResource

    engine, key = DeltaRsEngine(str(tmp_path)), slice_key(1)
    engine.ensure("entity_patches", SCHEMAS["entity_patches"])
    engine.commit("entity_patches", SCHEMAS["entity_patches"], add=[], operation="replace_slice", slice_key=key,
                  metadata={entities.WINDOW: "2"})
    context, now = SimpleNamespace(log=logging.getLogger("test")), SlicingResource(dedupe_window_slices=7)
    assert entities.dedupe_window(context, engine, key, now) == 7  # entity_patches' run again, nothing applied
    assert entities.dedupe_window(context, engine, key, now, patched=True) == 2


def test_patches_refuse_a_slice_while_any_slice_of_its_dedupe_window_is_not_ingested(pipeline):
    """Slice 2 failed at ingest while slices 3 and 4 went on: slice 4's patches would miss slice
    2's deliveries of its requests, and apply one redelivered there a second time."""
    keys = []
    for r in range(4):
        pipeline.produce([record(batch(60 + r, [patch(f"window-{r}", [{"op": "add", "path": "n", "value": r}])],
                                       begun=BEGUN + r))])
        [request] = pipeline.tick()
        keys.append(request.partition_key)
    k1, k2, k3, k4 = keys
    assert pipeline.run(k1).success
    for key in (k3, k4):
        assert pipeline.run(key, assets=pipeline.asset_keys_of("entity_batches")).success
    early = pipeline.run(k4, assets=pipeline.asset_keys_of("entity_patches"), raise_on_error=False)
    [failure] = [e for e in early.all_events if e.is_step_failure]
    assert f"entity_batches holds no slice {k2}" in pipeline.failure_text(failure)
    assert pipeline.run(k2, assets=pipeline.asset_keys_of("entity_batches")).success
    assert pipeline.run(k4, assets=pipeline.asset_keys_of("entity_patches")).success


def test_a_state_step_refuses_a_slice_whose_input_is_not_written_yet(pipeline):
    """Materializing a subset out of order (the UI lets one): apply_patches on a slice whose
    entity_patches has not run would apply nothing and record the slice as applied, and the
    slice's later runs would only replay it. It refuses, and the slice applies once its input is there."""
    pipeline.produce([record(samples.SEED_ENTITY_BATCH)])
    [request] = pipeline.tick()
    # entity_patches written empty would count as the slice's: apply_patches would then apply nothing
    early = pipeline.run(K1, assets=pipeline.asset_keys_of("entity_patches"), raise_on_error=False)
    [failure] = [e for e in early.all_events if e.is_step_failure]
    assert f"slice {K1}: entity_batches holds no rows of it yet" in pipeline.failure_text(failure)
    assert pipeline.run(K1, assets=pipeline.asset_keys_of("entity_batches")).success
    early = pipeline.run(K1, assets=pipeline.asset_keys_of("entity_updates"), raise_on_error=False)
    [failure] = [e for e in early.all_events if e.is_step_failure]
    assert failure.step_key == "apply_patches"
    assert f"slice {K1}: entity_patches holds no rows of it yet" in pipeline.failure_text(failure)
    # so do the stream steps after it, which would write the slice empty and hand that on
    for step, table in (("zone_changes", "entity_updates"), ("changes_by_device", "zone_changes")):
        early = pipeline.run(K1, assets=pipeline.asset_keys_of(step), raise_on_error=False)
        [failure] = [e for e in early.all_events if e.is_step_failure]
        assert failure.step_key == step
        assert f"slice {K1}: {table} holds no rows of it yet" in pipeline.failure_text(failure)
    assert pipeline.run_request(request).success
    assert one(rows(pipeline, "entities"))["entity"] == SALLY
    # the tables whose stream a later step publishes promise no publish record of their own: the
    # release before, which published them from their own step, still runs after this one
    engine = pipeline.engine
    assert "publish_recorded" not in engine.commit_after("entity_patches", K1, "replace_slice")
    assert "publish_recorded" not in engine.commit_after("changes_by_device", K1, "replace_slice")
    assert "publish_recorded" in engine.commit_after("entity_updates", K1, "replace_slice")


# --------------------------------------------------------------------------- 4-8: across slices

LIFE = "7e1f0c2b-4444-4000-8000-000000000004"  # created, deleted, re-created
DUP = "9a3b5c7d-5555-4000-8000-000000000005"  # its request is delivered three times
DEVICE = "device-00001"
SCHEMA_REQUEST = 14


def slice_records() -> tuple[list, list]:
    """Two slices of traffic touching every stream of the graph."""
    sub = batch(10, [patch("sub-" + DEVICE, [{"op": "add", "path": "", "value": {
        "subjectZone": "default", "device": DEVICE, "user": "jsmith"}}], collection=samples.SUBSCRIPTIONS)],
        begun=BEGUN)
    create = batch(11, [patch(LIFE, [{"op": "add", "path": "name", "value": "v1"}])], begun=BEGUN + 1, learning=True)
    delete = batch(12, [patch(LIFE, [{"op": "remove", "path": ""}])], begun=BEGUN + 2)
    dup = batch(13, [patch(DUP, [{"op": "add", "path": "count", "value": 1}])], begun=BEGUN + 3)
    reused = batch(13, [patch(DUP, [{"op": "add", "path": "count", "value": 2}])], begun=BEGUN + 7)  # id used again
    recreate = batch(15, [patch(LIFE, [{"op": "add", "path": "name", "value": "v2"}])], begun=BEGUN + 5,
                     learning=True)
    schema = {**samples.SEED_SCHEMA_PATCH, "request": SCHEMA_REQUEST, "parts": 2}
    part1 = {**schema, "part": 1}
    part2 = {**schema, "part": 2, "begun": schema["begun"],
             "ops": [{"op": "add", "path": "Contacts/fields/name", "value": {"type": "STRING", "optional": True}}]}
    connection = samples.SEED_CONNECTION
    first = [record(sub), record(create), record(delete), record(dup), record(dup),
             ("schema-patches", "my-db", samples.encode(part1)),
             ("connections", "jsmith", samples.encode({**connection, "device": DEVICE}))]
    second = [record(dup), record(recreate), record(reused),
              ("schema-patches", "my-db", samples.encode(part2)),
              ("connections", "jsmith", samples.encode({**connection, "device": DEVICE, "appVersion": "1.2",
                                                         "begun": connection["begun"] + 1})),
              ("notification-acks", DEVICE, samples.encode({"dbid": "my-db", "user": "jsmith", "device": DEVICE,
                                                             "upTo": samples.ACK_ALL, "begun": BEGUN + 6}))]
    return first, second


def test_apply_patches_refuses_a_slice_whose_slice_before_it_has_not_applied(pipeline):
    """Slice 1's patches exploded but never applied (its run stopped there): slice 2's own patches
    pass their checks, and apply_patches itself must refuse, applying nothing."""
    first, second = slice_records()
    pipeline.produce(first)
    [r1] = pipeline.tick()
    pipeline.produce(second)
    [r2] = pipeline.tick()
    assert pipeline.run(K1, assets=pipeline.asset_keys_of("entity_batches") + ["entity_patches"]).success
    refused = pipeline.run_request(r2, raise_on_error=False)
    [failure] = [e for e in refused.all_events if e.is_step_failure and e.step_key == "apply_patches"]
    assert "cannot be applied to entities: it holds slices up to" in pipeline.failure_text(failure)
    assert f"slice {K1} is missing" in pipeline.failure_text(failure)
    assert pipeline.engine.applied("entities", "entity-assets") is None


def snapshot(pipeline) -> dict:
    out = {("stream", t, k): slice_rows(pipeline, t, k) for t in STREAM_TABLES for k in (K1, K2)}
    out.update({("state", t): canonical(pipeline.read(t).to_pylist()) for t in STATE_TABLES})
    out.update({("version", t): pipeline.engine.version(t) for t in STATE_TABLES})
    return out


@pytest.mark.parametrize(("driver_rows", "state_file_rows"), [(SparkResource().driver_rows, None), (0, 1)],
                         ids=["driver", "split-tasks-one-key-state-files"])
def test_slices_apply_in_order_dedupe_straddle_and_replay_identically(make_pipeline, driver_rows, state_file_rows):
    # both ways of finding earlier deliveries: in the driver, and in Spark tasks that split the
    # identities among them; and state files of one key each, so every bucket is split into
    # shards and rewritten shard by shard
    pipeline = make_pipeline(state_file_rows=state_file_rows, driver_rows=driver_rows)
    first, second = slice_records()
    pipeline.produce(first)
    [r1] = pipeline.tick()
    pipeline.produce(second)
    [r2] = pipeline.tick()
    assert (r1.partition_key, r2.partition_key) == (K1, K2)

    # 7. out of order: slice 2 before slice 1 is refused, naming the missing slice
    refused = pipeline.run_request(r2, raise_on_error=False)
    assert not refused.success
    failures = [e for e in refused.all_events if e.is_step_failure]
    assert failures
    # refused where state or redelivery detection needs slice 1: before any patch is exploded or applied
    assert {e.step_key for e in failures} >= {"entity_patches", "devices"}
    succeeded = {e.step_key for e in refused.all_events if e.event_type_value == "STEP_SUCCESS"}
    assert "apply_patches" not in succeeded and "entity_patches" not in succeeded
    for event in failures:
        assert "slice 0000000001 is missing" in pipeline.failure_text(event), event.step_key
    engine = pipeline.engine
    assert not engine.exists("entities") or engine.applied("entities", "entity-assets") is None  # nothing applied

    one_ = pipeline.run_request(r1)
    assert one_.success
    meta1 = pipeline.materializations(one_)

    # 4. deletion: a tombstone with the version counting the deletion
    life = one(rows(pipeline, "entities", entity=LIFE))
    assert life["deleted"] is True and life["document"] is None and life["version"] == 2
    updates = sorted(rows(pipeline, "entity_updates", entity=LIFE), key=lambda r: r["begun"])
    assert [r["action"] for r in updates] == ["created", "deleted"]
    assert json.loads(updates[1]["before"]) == {"name": "v1"} and updates[1]["after"] is None

    # 5. the duplicate in one slice: exploded once, counted
    # (slice 2 is already ingested: the refused run got that far)
    assert len(rows(pipeline, "entity_batches", request=13, slice=K1)) == 2  # the durable log keeps both
    assert len(rows(pipeline, "entity_patches", request=13, slice=K1)) == 1
    assert meta1["entity_patches"]["duplicates"] == 1 and meta1["entity_patches"]["batches"] == 5
    patches1 = meta1["entity_patches"]["dagster/row_count"]
    assert patches1 == meta1["entity_patches"]["dagster/partition_row_count"] > 0  # the table's rows: the first slice's

    # 6. part 1 of 2 of a schema request: pending, not complete
    assert not rows(pipeline, "complete_responses", request=SCHEMA_REQUEST)
    pending = one(rows(pipeline, "pending_responses"))
    assert (pending["clientid"], pending["request"], pending["part"], pending["parts"]) == (
        CLIENT, SCHEMA_REQUEST, 1, 2)
    assert pending["stream"] == "schema-updates" and pending["status"] == 1
    assert meta1["partial_responses"]["pending_parts"] == 1

    two = pipeline.run_request(r2)
    assert two.success
    meta2 = pipeline.materializations(two)

    # 4. re-created: the version continues past the tombstone
    life = one(rows(pipeline, "entities", entity=LIFE))
    assert life["deleted"] is False and life["version"] == 3 and json.loads(life["document"]) == {"name": "v2"}
    recreated = one(rows(pipeline, "entity_updates", entity=LIFE, slice=K2))
    assert recreated["action"] == "created" and recreated["before"] is None
    assert json.loads(recreated["after"]) == {"name": "v2"}

    # the UI's row count of a stream: every slice's rows, its partition row count this slice's
    assert meta2["entity_patches"]["dagster/row_count"] == patches1 + meta2["entity_patches"]["dagster/partition_row_count"]

    # 5. redelivered in the next slice: still applied once; its id used again for another request
    # (another `begun`): left out too, its record kept, and named by a warning
    assert len(rows(pipeline, "entity_batches", request=13)) == 4
    assert len(rows(pipeline, "entity_patches", request=13)) == 1
    assert len(rows(pipeline, "partial_responses", request=13)) == 1
    assert len(rows(pipeline, "complete_responses", request=13)) == 1
    assert one(rows(pipeline, "entities", entity=DUP))["version"] == 1
    assert meta2["entity_patches"]["duplicates"] == 2 and meta2["entity_patches"]["batches"] == 3
    assert meta2["entity_patches"]["reused_request_ids"] == 1 and meta1["entity_patches"]["reused_request_ids"] == 0
    [schema_reuse] = [e for e in two.get_asset_check_evaluations() if e.asset_key == AssetKey("schema_updates")
                      and e.check_name == "request_ids_not_reused"]
    assert schema_reuse.passed and meta2["schema_updates"]["reused_request_ids"] == 0  # part 2 is another part
    [reuse] = [e for e in two.get_asset_check_evaluations() if e.asset_key == AssetKey("entity_patches")]
    assert (reuse.check_name, reuse.passed, reuse.severity) == ("request_ids_not_reused", False, AssetCheckSeverity.WARN)
    [named] = reuse.metadata["first"].value
    again = one(rows(pipeline, "entity_batches", request=13, slice=K2, begun=BEGUN + 7))
    assert named == {"clientid": CLIENT, "request": 13,
                     "kafka": f"{again['kafka_topic']}:{again['kafka_partition']}:{again['kafka_offset']}"}
    # its trace says why it stops at entity_batches
    trail = trace.trace(pipeline.engine, again["kafka_topic"], again["kafka_partition"], again["kafka_offset"])
    assert list(trail.rows) == ["entity_batches"] and "left out of entity_patches: its clientid, request came " \
        "before" in trace.format_trail(trail)

    # 6. part 2 completes the request in slice 2, both parts ordered
    complete = one(rows(pipeline, "complete_responses", request=SCHEMA_REQUEST))
    assert complete["slice"] == K2 and complete["parts"] == 2
    responses = json.loads(complete["responses"])
    assert [(r["part"], r["parts"], r["status"]) for r in responses] == [(1, 2, 1), (2, 2, 1)]
    assert complete["ended"] == responses[1]["ended"]
    assert not rows(pipeline, "pending_responses")
    assert meta2["partial_responses"]["pending_parts"] == 0
    on_topic = one(messages(pipeline, "complete-responses", request=SCHEMA_REQUEST))
    assert on_topic["value"]["responses"] == responses
    assert on_topic["partition"] == partition_for(CLIENT, partitions_of(pipeline, "complete-responses"))
    if state_file_rows == 1:
        state = pipeline.engine.files("entities")
        assert len(state) == len(rows(pipeline, "entities")) and max(f.rows for f in state) == 1
        assert meta2["entities"]["replaced_files"] == 1  # slice 2 rewrote only the file of its one key, LIFE
    for result in (one_, two):
        checks = pipeline.checks(result)
        for name in ("updates_are_successes", "responses_have_every_part", "one_row_per_entity"):
            assert checks[name].passed is True, (name, checks)

    # 8. re-running slices 1 and 2 (replays) rewrites exactly the same rows and leaves the state
    before = snapshot(pipeline)
    assert before[("stream", "changes_by_device", K1)] and before[("stream", "device_notifications", K1)]
    assert before[("stream", "changes_by_device", K2)] and before[("stream", "schema_learning", K2)]
    again1 = pipeline.run(K1)
    again2 = pipeline.run(K2)
    assert again1.success and again2.success
    for result, key in ((again1, K1), (again2, K2)):
        meta = pipeline.materializations(result)
        assert meta["entities"]["replayed"] is True and meta["schemas"]["replayed"] is True
        # the version the slice made, not the newest, which holds the later slices' state too
        for table in ("entities", "schemas", "learned_schemas", "devices"):
            assert meta[table]["delta_version"] == pipeline.engine.version_after(table, key, "apply"), table
    after = snapshot(pipeline)
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, changed
    for table in STREAM_TABLES:
        repeated = [r for r, n in Counter(canonical(pipeline.read(table).to_pylist())).items() if n > 1]
        assert not repeated, (table, repeated[:2])
    keys = Counter((r["dbid"], r["collection"], r["zone"], r["entity"]) for r in rows(pipeline, "entities"))
    assert keys and max(keys.values()) == 1
    parts = Counter((r["clientid"], r["request"], r["part"], r["stream"]) for r in rows(pipeline, "partial_responses"))
    assert max(parts.values()) == 1


def test_the_updates_preview_keeps_client_text_in_its_cell():
    from entity_assets.assets.common import md_cell

    assert md_cell('{"a": "x|y"}\nz\\') == '`{"a": "x\\|y"} z\\`'
    # a code span: markdown's marks and GFM's bare links render as text, not as a client's link or
    # remote image in the operator's UI; its fence is longer than any backtick run of the text
    assert md_cell("[Sign in again](https://evil.example) ![](https://evil.example/px.png) www.evil.example") == (
        "`[Sign in again](https://evil.example) ![](https://evil.example/px.png) www.evil.example`")
    assert md_cell("a``b") == "```a``b```" and md_cell("`x`") == "`` `x` ``" and md_cell("") == ""


def test_client_text_cannot_close_a_trail_s_fence_nor_drive_a_terminal():
    """A `user` of "bob\\n```\\n[link](…)" closed trace_job's fence; ESC sequences in a dbid set the
    operator's window title and cleared the screen of `entity-assets trace`."""
    from entity_assets.assets.common import fenced
    from entity_assets.trace import printable

    assert fenced("user=bob ```` [x](y)") == "`````\nuser=bob ```` [x](y)\n`````"
    assert printable("db\x1b]0;pwned\x07\nx\u202ey") == "db\\u001b]0;pwned\\u0007\\u000ax\\u202ey"
    assert printable("é 名前") == "é 名前"
