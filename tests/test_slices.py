"""Slice planning (entity_assets.slices) and the sensor cursor: pure functions, no broker, no Spark."""

from __future__ import annotations

import random
import time

import pyarrow as pa
import pytest

from entity_assets.sensors import dump_cursor, load_cursor
from entity_assets.slices import (
    MANIFEST_SCHEMA,
    Manifest,
    OffsetRange,
    SlicePolicy,
    manifest_to_arrow,
    manifests_from_arrow,
    plan_slices,
    read_to,
    slice_key,
    slice_seq,
    split_ranges,
)

NOW = 1_700_000_000_000
A0, A1, B0 = ("acme.prod.entity-batches", 0), ("acme.prod.entity-batches", 1), ("acme.prod.connections", 0)


def plan(positions, ends, *, interval=900.0, max_messages=1_000, next_seq=1, last_closed_at=None, now=NOW):
    return plan_slices(positions, ends, policy=SlicePolicy(interval, max_messages), next_seq=next_seq,
                       last_closed_at=last_closed_at, now=now)


def assert_covers(slices: list[Manifest], positions, ends, max_messages: int, first_seq: int) -> None:
    """Each slice <= max, every topic-partition in every manifest, contiguous, exactly the backlog."""
    assert [s.seq for s in slices] == list(range(first_seq, first_seq + len(slices)))
    at = {tp: positions.get(tp, 0) for tp in ends}
    for s in slices:
        assert 0 < s.messages <= max_messages
        assert {(r.topic, r.partition) for r in s.ranges} == set(ends)
        for r in s.ranges:
            tp = (r.topic, r.partition)
            assert r.start == at[tp] and r.start <= r.end, (s.key, r)
            at[tp] = r.end
    assert at == {tp: max(ends[tp], positions.get(tp, 0)) for tp in ends}
    assert sum(s.messages for s in slices) == sum(max(0, e - positions.get(tp, 0)) for tp, e in ends.items())


def test_nothing_pending_closes_nothing():
    assert plan({}, {}) == []
    assert plan({A0: 5, A1: 7}, {A0: 5, A1: 7}) == []
    assert plan({A0: 5}, {A0: 5}, last_closed_at=None, interval=0) == []


def test_interval_not_due_waits():
    recent = NOW - 10_000  # 10 s ago, interval 900 s
    assert plan({A0: 0}, {A0: 10}, last_closed_at=recent) == []


def test_due_closes_one_slice_of_everything():
    for last in (None, NOW - 900_000, NOW - 10_000_000):
        [s] = plan({A0: 3, A1: 0}, {A0: 10, A1: 4, B0: 2}, last_closed_at=last, next_seq=8)
        assert s.seq == 8 and s.key == "0000000008" and s.closed_at == NOW
        assert sorted(s.ranges) == [OffsetRange(*B0, 0, 2), OffsetRange(*A0, 3, 10), OffsetRange(*A1, 0, 4)]
        assert s.messages == 13
        assert s.positions() == {A0: 10, A1: 4, B0: 2}


def test_empty_partitions_stay_in_the_manifest():
    [s] = plan({A0: 4, A1: 9}, {A0: 6, A1: 9})
    assert OffsetRange(*A1, 9, 9) in s.ranges
    assert s.positions() == {A0: 6, A1: 9}  # the next slice starts the empty one where it was


def test_full_slice_closes_before_the_interval():
    slices = plan({A0: 0}, {A0: 2_500}, last_closed_at=NOW - 1, max_messages=1_000)
    assert slices and all(s.messages <= 1_000 for s in slices)
    assert slices[0].messages == 1_000
    # exactly full, or exactly two full: closed at once, each a full slice
    assert [s.messages for s in plan({A0: 0}, {A0: 1_000}, last_closed_at=NOW - 1)] == [1_000]
    assert [s.messages for s in plan({A0: 0}, {A0: 2_000}, last_closed_at=NOW - 1)] == [1_000, 1_000]
    assert plan({A0: 0}, {A0: 999}, last_closed_at=NOW - 1) == []  # not full: waits for the interval


def test_backlog_over_max_splits_into_contiguous_slices():
    positions = {A0: 100, A1: 0, B0: 7}
    ends = {A0: 2_100, A1: 13, B0: 1_007}
    slices = plan(positions, ends, max_messages=500, next_seq=42)
    assert len(slices) == 7  # ceil(3013 / 500)
    assert_covers(slices, positions, ends, 500, 42)
    assert all(s.closed_at == NOW for s in slices)
    # each slice takes a share of every partition with a backlog, not one partition after another
    assert all(r.count > 0 for r in slices[0].ranges)


def test_backlog_random_shapes_are_covered_exactly():
    rng = random.Random(11)
    for _ in range(300):
        n = rng.randint(1, 6)
        tps = [(f"t{rng.randint(0, 2)}", p) for p in range(n)]
        positions = {tp: rng.randint(0, 50) for tp in tps if rng.random() < 0.8}
        max_messages = rng.choice([1, 3, 100, 999, 10_000])
        big = 20 if max_messages < 10 else 5_000  # at most a few hundred slices per case
        ends = {tp: positions.get(tp, 0) + rng.choice([0, 1, 2, rng.randint(0, big)]) for tp in tps}
        slices = plan(positions, ends, interval=0, max_messages=max_messages, next_seq=5)
        assert_covers(slices, positions, ends, max_messages, 5)


def test_offsets_kafka_no_longer_holds_go_to_the_first_slice_and_count_toward_no_slice_s_size():
    """A stop past the retention: the span gone is read as one dead letter, not max_messages at a
    time as slices of nothing else; the records left are split as any backlog."""
    positions, ends, firsts = {A0: 0, A1: 50, B0: 7}, {A0: 10_000, A1: 1_050, B0: 7}, {A0: 9_000, A1: 40, B0: 7}
    slices = plan_slices(positions, ends, policy=SlicePolicy(0, 500), next_seq=1, last_closed_at=None, now=NOW,
                         firsts=firsts)
    assert len(slices) == 4  # the 2,000 records held, 500 at a time
    assert {(r.topic, r.partition): (r.start, r.end) for r in slices[0].ranges} == {
        A0: (0, 9_250), A1: (50, 300), B0: (7, 7)}
    assert_covers(slices, positions, ends, 10_000, 1)
    assert all(s.messages <= 500 for s in slices[1:])
    # a partition held (its offsets went back: the sensor ends it at its position) takes nothing
    assert plan_slices({A0: 500, A1: 0}, {A0: 500, A1: 10}, policy=SlicePolicy(0, 500), next_seq=1, last_closed_at=None,
                       now=NOW, firsts={A0: 900, A1: 0})[0].ranges == (OffsetRange(*A0, 500, 500), OffsetRange(*A1, 0, 10))
    # a span gone and nothing since: the next slice, once due, takes it
    assert plan_slices({A0: 0}, {A0: 900}, policy=SlicePolicy(0, 500), next_seq=1, last_closed_at=None, now=NOW,
                       firsts={A0: 900})[0].ranges == (OffsetRange(*A0, 0, 900),)


def test_positions_of_unknown_partitions_start_at_zero():
    [s] = plan({}, {A0: 3})
    assert s.ranges == (OffsetRange(*A0, 0, 3),)


def test_slice_keys_sort_in_slice_order():
    keys = [slice_key(n) for n in (1, 2, 9, 10, 11, 99, 100, 12345, 9_999_999_999)]
    assert sorted(keys) == keys
    assert all(len(k) == 10 for k in keys)
    assert [slice_seq(k) for k in keys] == [1, 2, 9, 10, 11, 99, 100, 12345, 9_999_999_999]
    for bad in ("", "abc", "-1", "1.0", " 1", "5", "00000000005", "٠٠٠٠٠٠٠٠٠٥"):
        with pytest.raises(ValueError):
            slice_seq(bad)


def test_split_ranges_cuts_task_sized_contiguous_pieces():
    ranges = [OffsetRange("a", 0, 10, 2_510), OffsetRange("a", 1, 5, 5), OffsetRange("b", 0, 0, 1_000)]
    pieces = split_ranges(ranges, 1_000)
    assert [(p.topic, p.partition, p.start, p.end) for p in pieces] == [
        ("a", 0, 10, 1_010), ("a", 0, 1_010, 2_010), ("a", 0, 2_010, 2_510), ("b", 0, 0, 1_000),
    ]
    assert split_ranges([], 10) == []
    assert split_ranges([OffsetRange("a", 0, 3, 4)], 1) == [OffsetRange("a", 0, 3, 4)]
    rng = random.Random(3)
    for _ in range(100):
        r = OffsetRange("x", 0, rng.randint(0, 100), 0)
        r = OffsetRange("x", 0, r.start, r.start + rng.randint(0, 5_000))
        size = rng.randint(1, 700)
        parts = split_ranges([r], size)
        assert all(0 < p.count <= size for p in parts)
        assert sum(p.count for p in parts) == r.count
        assert all(a.end == b.start for a, b in zip(parts, parts[1:]))


def test_a_span_kafka_no_longer_holds_is_one_task_whatever_its_size():
    ranges = [OffsetRange(*A0, 0, 10_500), OffsetRange(*A1, 100, 350), OffsetRange(*B0, 0, 40)]
    assert split_ranges(ranges, 100, {A0: 10_250, A1: 0, B0: 900}) == [
        OffsetRange(*A0, 0, 10_250), OffsetRange(*A0, 10_250, 10_350), OffsetRange(*A0, 10_350, 10_450),
        OffsetRange(*A0, 10_450, 10_500), OffsetRange(*A1, 100, 200), OffsetRange(*A1, 200, 300),
        OffsetRange(*A1, 300, 350), OffsetRange(*B0, 0, 40)]
    assert split_ranges(ranges, 100) == split_ranges(ranges, 100, {})


def test_manifest_arrow_round_trip():
    slices = plan({A0: 1}, {A0: 40, A1: 0, B0: 9}, max_messages=20, next_seq=3)
    assert len(slices) > 1
    table = pa.concat_tables([manifest_to_arrow(s) for s in slices])
    assert table.schema == MANIFEST_SCHEMA
    assert manifests_from_arrow(table) == {s.seq: s for s in slices}


@pytest.mark.parametrize("positions", [{}, {A0: 0}, {A0: 17, A1: 3, B0: 0, ("we|ird.topic", 12): 5}])
@pytest.mark.parametrize("closed_at", [None, NOW])
@pytest.mark.parametrize("lag", [None, {"at": NOW, "holds": 3, "last": 7, "runs": 1.5, "committed": 3,
                                         "streams": ["entity-batches"]}])
@pytest.mark.parametrize("adopted", [0, 5])
def test_cursor_round_trip(positions, closed_at, lag, adopted):
    raw = dump_cursor(7, positions, closed_at, lag, adopted)
    assert isinstance(raw, str)
    assert load_cursor(raw) == (7, positions, closed_at, lag, adopted)
    assert dump_cursor(*load_cursor(raw)) == raw


def test_cursor_of_a_new_sensor_is_empty():
    assert load_cursor(None) == (0, {}, None, None, 0)
    assert load_cursor("") == (0, {}, None, None, 0)


def test_the_lake_has_read_each_partition_to_the_last_slice_done_or_from_its_first_offset():
    marks = {A0: (0, 10), A1: (4, 9), B0: (0, 3), ("c", 0): (5, 5)}
    # A0: read to the slice's end; A1: no slice read it; B0: behind the slices (its topic created
    # again): all unread; c: empty. A partition the broker no longer lists (gone) is left out.
    assert read_to({A0: 4, B0: 7, ("gone", 0): 3}, marks) == {A0: 4, A1: 4, B0: 0, ("c", 0): 5}
    # records deleted past the slice (retention): from the first offset held
    assert read_to({A1: 2}, {A1: (6, 9)}) == {A1: 6}


def test_cursor_and_manifest_agree_on_the_next_start():
    [s] = plan({A0: 2}, {A0: 9, A1: 4})
    seq, positions, closed_at, _, _ = load_cursor(dump_cursor(s.seq, s.positions(), s.closed_at))
    [nxt] = plan(positions, {A0: 12, A1: 4}, next_seq=seq + 1, last_closed_at=closed_at, interval=0)
    assert nxt.seq == 2
    assert {(r.topic, r.partition): r.start for r in nxt.ranges} == s.positions()


@pytest.mark.parametrize("setting", [{"max_messages": 0}, {"max_messages": -5}, {"max_messages_per_task": 0},
                                     {"min_interval_seconds": -1}, {"dedupe_window_slices": -1}])
def test_slice_sizes_that_would_hang_or_mean_nothing_are_refused(setting):
    """max_messages 0 made the sensor's planning loop forever."""
    from pydantic import ValidationError

    from resources import SlicingResource

    with pytest.raises(ValidationError):
        SlicingResource(**setting)


def test_the_closing_times_of_every_slice_come_from_the_log_not_the_files(tmp_path, monkeypatch):
    """`entity-assets run` and a sensor catching up read them all: the manifest table has a file
    per slice, which the log's statistics describe."""
    from entity_assets.manifests import ManifestStore, MissingManifest
    from entity_assets.storage import DeltaRsEngine

    store = ManifestStore(DeltaRsEngine(str(tmp_path / "lake")))
    assert store.closed_at() == {}
    for seq in (1, 2, 3):
        store.write(Manifest(seq, (OffsetRange("t", 0, seq, seq + 1), OffsetRange("t", 1, 0, 0)), NOW + seq))
    # slices requested again (their runs' tags): their own files only, in one read
    many = store.get_many([3, 1])
    assert {seq: m.messages for seq, m in many.items()} == {1: 1, 3: 1} and many[3] == store.get(3)
    assert store.get_many([]) == {}
    with pytest.raises(MissingManifest, match="slice 0000000004"):
        store.get_many([2, 4])
    monkeypatch.setattr(store.engine, "read", lambda *a, **k: pytest.fail("read a data file"))
    assert store.closed_at() == {1: NOW + 1, 2: NOW + 2, 3: NOW + 3}
    assert set(store.get_many([1, 2])) == {1, 2}  # from the slices' files, not the table whole


def test_trace_finds_a_record_s_slice_in_log2_manifests_and_where_offsets_went_back_in_all(tmp_path, monkeypatch):
    from entity_assets import trace
    from entity_assets.manifests import ManifestStore
    from entity_assets.storage import DeltaRsEngine
    from entity_assets.trace import slice_holding

    engine = DeltaRsEngine(str(tmp_path / "lake"))
    store = ManifestStore(engine)
    assert slice_holding(engine, "t", 0, 0) is None  # no slice yet
    for seq in range(1, 65):  # partition 0 grows by 10 a slice, partition 1 stays idle; topic "u" from slice 40 on
        ranges = [OffsetRange("t", 0, (seq - 1) * 10, seq * 10), OffsetRange("t", 1, 0, 0)]
        if seq >= 40:
            ranges.append(OffsetRange("u", 0, (seq - 40) * 3, (seq - 39) * 3))
        store.write(Manifest(seq, tuple(ranges), NOW + seq))
    reads = []
    get = ManifestStore.get
    monkeypatch.setattr(ManifestStore, "get", lambda self, seq: reads.append(seq) or get(self, seq))
    scan = trace.read_tables
    monkeypatch.setattr(trace, "read_tables", lambda *a, **k: pytest.fail("read every manifest"))
    assert slice_holding(engine, "t", 0, 0) == slice_key(1) and slice_holding(engine, "t", 0, 639) == slice_key(64)
    reads.clear()
    assert slice_holding(engine, "t", 0, 415) == slice_key(42) and len(reads) <= 8  # 1 + log2(64) + 1, of 64
    assert slice_holding(engine, "u", 0, 4) == slice_key(41)
    assert slice_holding(engine, "t", 0, 640) is None and slice_holding(engine, "t", 1, 0) is None  # past every slice
    monkeypatch.setattr(trace, "read_tables", scan)
    assert slice_holding(engine, "v", 0, 0) is None  # a partition no slice names
    # the topic deleted and created again, read from its first offset (offsets_went_back="restart"):
    # an offset of both lives is found in a slice of either; past the new life's end, in none
    store.write(Manifest(65, (OffsetRange("t", 0, 0, 5), OffsetRange("t", 1, 0, 0)), NOW + 65))
    store.write(Manifest(66, (OffsetRange("t", 0, 5, 20), OffsetRange("t", 1, 0, 0)), NOW + 66))
    assert slice_holding(engine, "u", 0, 4) == slice_key(41)  # a topic the newest slices no longer name (deleted)
    assert slice_holding(engine, "t", 0, 12) in (slice_key(2), slice_key(66))
    assert slice_holding(engine, "t", 0, 415) is None


@pytest.mark.parametrize("text", ["t:0", "t:0:", ":0:1", "t:-1:1", "t:0:1.5", "t:\u00b2:1", "t:0:\u0661\u0662"])
def test_a_record_is_topic_partition_offset_in_ascii_digits(text):
    from entity_assets.trace import parse_record

    assert parse_record("a:b:0:12", str.upper) == ("A:B", 0, 12)  # a topic's colons are its own
    with pytest.raises(ValueError, match="is not TOPIC:PARTITION:OFFSET"):
        parse_record(text, str)
def test_a_held_record_s_trail_keeps_its_own_slice_s_dead_letter_and_a_later_one_in_slice_order(tmp_path):
    """With schema_wait_slices=0, a Qlik data message waits and is an EA-SCHEMA-UNKNOWN dead letter in
    its own slice; once decoded in a later slice, it may be a dead letter again."""
    from entity_assets.manifests import ManifestStore
    from entity_assets.storage import DeltaRsEngine, FileWriter
    from entity_assets.tables import SCHEMAS
    from entity_assets.trace import format_trail, trace

    engine, topic = DeltaRsEngine(str(tmp_path / "lake")), "acme.prod.qlik.erp"
    for seq in range(1, 4):
        ManifestStore(engine).write(Manifest(seq, (OffsetRange(topic, 0, (seq - 1) * 10, seq * 10),), NOW + seq))

    def put(table, seq, *rows):
        engine.ensure(table, SCHEMAS[table])
        writer = FileWriter(table, engine.uri(table), SCHEMAS[table], slice_key(seq))
        for row in rows:
            writer.append({"slice": slice_key(seq), "kafka_topic": topic, "kafka_partition": 0, "kafka_offset": 8,
                           "kafka_timestamp": NOW, "stream": "erp", **row})
        engine.replace_slice(table, SCHEMAS[table], writer.close(), slice_key(seq))

    put("schema_waits", 1, {"code": "EA-SCHEMA-PENDING", "reason": "waits for schema s", "schemaId": "s"})
    put("dead_letters", 1, {"code": "EA-SCHEMA-UNKNOWN", "reason": "no schema s within 0 slices"})
    put("dead_letters", 3, {"code": "GENERR001", "reason": "bad once decoded, again"})
    put("dead_letters", 2, {"code": "GENERR001", "reason": "bad once decoded"})  # after slice 3's, as a re-run writes
    trail = trace(engine, topic, 0, 8)
    assert trail.slice == slice_key(1)
    assert [r["reason"] for r in trail.rows["dead_letters"]] == [
        "no schema s within 0 slices", "bad once decoded", "bad once decoded, again"]
    assert format_trail(trail).count("dead_letters") == 3


def test_the_newest_whole_run_of_a_slice_decides_whether_a_restore_lost_it():
    """`newest_whole` on a real (ephemeral) instance's run records, tagged as Dagster tags them:
    subset runs neither hide a whole run nor stand for one; a re-execution of a whole run (the
    UI's From asset failure, which records only the failed assets) counts as it; the sensor's
    request launched again is the newest once launched; runs of the key before the slice closed
    are not the slice's."""
    from dagster import AssetKey, DagsterInstance, DagsterRun, DagsterRunStatus

    from entity_assets.sensors import PARTITION_TAG, ROOT_RUN_TAG, STATE_ASSETS, newest_whole

    instance = DagsterInstance.ephemeral()
    runs = iter(range(1000))

    def add(seq, status, assets=None, root=None, job="slice_job"):
        run_id = f"00000000-0000-4000-8000-{next(runs):012d}"
        tags = {PARTITION_TAG: slice_key(seq), **({ROOT_RUN_TAG: root} if root else {})}
        instance.add_run(DagsterRun(job_name=job, run_id=run_id, status=status, tags=tags,
                                    asset_selection=frozenset(assets) if assets is not None else None))
        return run_id

    closed = int(time.time() * 1000) - 60_000
    one = frozenset([AssetKey("learned_schemas")])
    add(1, DagsterRunStatus.SUCCESS)
    add(1, DagsterRunStatus.SUCCESS, one)  # an asset materialized again after it
    failed = add(2, DagsterRunStatus.FAILURE)
    add(2, DagsterRunStatus.SUCCESS, one, root=failed)  # From asset failure, finished
    add(3, DagsterRunStatus.SUCCESS)
    add(3, DagsterRunStatus.STARTED)  # the sensor's request, launched
    add(4, DagsterRunStatus.SUCCESS, one)  # only subsets
    add(5, DagsterRunStatus.SUCCESS, STATE_ASSETS | one, job="__ASSET_JOB")  # the UI's Materialize all
    add(5, DagsterRunStatus.FAILURE, one)
    add(6, DagsterRunStatus.SUCCESS)
    add(6, DagsterRunStatus.FAILURE)  # a whole re-run that failed
    assert newest_whole(instance, {seq: closed for seq in range(1, 8)}) == {
        1: DagsterRunStatus.SUCCESS, 2: DagsterRunStatus.SUCCESS, 3: DagsterRunStatus.STARTED,
        5: DagsterRunStatus.SUCCESS, 6: DagsterRunStatus.FAILURE}
    assert newest_whole(instance, {1: closed + 3_600_000 * 24}) == {}  # created before the slice closed


def _ticks(tmp_path, marks: dict):
    """The sensor over a lake in `tmp_path` and a Kafka whose offsets are `marks` as they are at
    each call ((topic, partition) -> (first, end); a partition left out gives none): a function
    of the slicing settings that ticks once, keeping the cursor, and returns the SensorResult."""
    from dagster import DagsterInstance, build_sensor_context

    from entity_assets.sensors import kafka_offsets_sensor
    from resources import KafkaResource, LakeResource

    class Kafka(KafkaResource):
        def input_watermarks(self, timeout=10.0, unanswered=None):
            return dict(marks)

    resources = {"kafka": Kafka(commit_offsets=False, publish=False), "lake": LakeResource(root=str(tmp_path / "lake"))}
    instance, cursor = DagsterInstance.ephemeral(), [None]

    def tick(**slicing):
        from resources import SlicingResource

        with build_sensor_context(instance=instance, cursor=cursor[0],
                                  resources={**resources, "slicing": SlicingResource(**{"min_interval_seconds": 0,
                                                                                          **slicing})}) as context:
            result = kafka_offsets_sensor(context)
        cursor[0] = result.cursor
        return result

    return tick


def _manifest(tmp_path, seq: int) -> dict:
    from entity_assets.manifests import ManifestStore
    from entity_assets.storage import DeltaRsEngine

    return {(r.topic, r.partition): (r.start, r.end)
            for r in ManifestStore(DeltaRsEngine(str(tmp_path / "lake"))).get(seq).ranges}


def test_a_topic_created_again_is_held_whole_and_a_partition_kafka_gives_no_offsets_of_stays_held(tmp_path):
    """One partition of a topic went back: all of it is held, those whose new records passed the
    slices' offsets before a tick looked too (a hot partition's offset is far past its new end, the
    quiet ones' already passed). A restart reads those Kafka answers for from their first offsets;
    one it gives no offsets of stays held, and is restarted once it does, not read on from the
    slices' offset."""
    t = "entity-batches"
    marks = {(t, 0): (0, 1_000_000), **{(t, p): (0, 100) for p in (1, 2, 3)}}
    tick = _ticks(tmp_path, marks)
    assert tick().run_requests
    marks.update({(t, 0): (0, 50), **{(t, p): (0, 150) for p in (1, 2, 3)}})
    result = tick()
    assert not result.run_requests and f"{t}[1] ends at 150, next 100" in result.skip_reason.skip_message
    del marks[(t, 3)]
    assert tick(offsets_went_back="restart").run_requests
    assert _manifest(tmp_path, 2) == {(t, 0): (0, 50), (t, 1): (0, 150), (t, 2): (0, 150), (t, 3): (100, 100)}
    marks[(t, 3)] = (0, 160)
    result = tick()
    assert not result.run_requests and f"{t}[3] ends at 160, next 100" in result.skip_reason.skip_message
    result = tick(offsets_went_back="restart", min_interval_seconds=3600)  # not due: no slice, no offset moved
    assert not result.run_requests and load_cursor(result.cursor).positions[(t, 3)] == 100
    assert tick(offsets_went_back="restart").run_requests
    assert _manifest(tmp_path, 3) == {(t, 0): (50, 50), (t, 1): (150, 150), (t, 2): (150, 150), (t, 3): (0, 160)}
    marks.update({(t, 0): (0, 60), (t, 3): (0, 170)})
    assert tick().run_requests  # none held
    assert _manifest(tmp_path, 4) == {(t, 0): (50, 60), (t, 1): (150, 150), (t, 2): (150, 150), (t, 3): (160, 170)}


def test_a_log_cut_short_is_held_until_continue_reads_on_from_the_slices_offsets(tmp_path):
    """An unclean leader election cut one partition's log short: its topic is held (offsets cannot
    tell it from a topic created again) until `continue`, which goes on from the slices' offsets,
    each partition once its end is past them, and empties the note."""
    t = "entity-batches"
    marks = {(t, p): (0, 50_000) for p in range(3)}
    tick = _ticks(tmp_path, marks)
    assert tick().run_requests
    marks.update({(t, 0): (0, 49_990), (t, 1): (0, 50_400), (t, 2): (0, 50_400)})
    result = tick()
    assert not result.run_requests and "or continue (read on from the slices' offsets" in result.skip_reason.skip_message
    assert tick(offsets_went_back="continue").run_requests
    assert _manifest(tmp_path, 2) == {(t, 0): (50_000, 50_000), (t, 1): (50_000, 50_400), (t, 2): (50_000, 50_400)}
    marks[(t, 0)] = (0, 50_100)
    assert tick().run_requests  # held no more
    assert _manifest(tmp_path, 3) == {(t, 0): (50_000, 50_100), (t, 1): (50_400, 50_400), (t, 2): (50_400, 50_400)}


def test_the_sensor_warns_on_an_instance_whose_pools_let_slices_runs_interleave(project_instance, monkeypatch):
    """The project's dagster.yaml counts the lake pool per run, one run at a time; an instance left
    at Dagster's default (per op) would let two slices' steps interleave, and a limit above 1 (or
    none, or the default_limit alone before a dequeue made the pool) would start their runs together."""
    from dagster import DagsterInstance

    from entity_assets.partitions import LAKE_POOL
    from entity_assets.sensors import pool_warning

    assert "limited to 1 only by dagster.yaml's default_limit" in pool_warning(project_instance)
    project_instance.event_log_storage.set_concurrency_slots(LAKE_POOL, 1)  # as scripts/ui.sh does
    assert pool_warning(project_instance) is None
    with DagsterInstance.ephemeral() as instance:
        assert "count per op, not per run" in pool_warning(instance)
    project_instance.event_log_storage.set_concurrency_slots(LAKE_POOL, 2)  # a shared instance's own limit
    assert f"pool {LAKE_POOL} is limited to 2 runs" in pool_warning(project_instance)
    project_instance.event_log_storage.set_concurrency_slots(LAKE_POOL, 1)
    settings = type(project_instance).get_settings
    monkeypatch.setattr(type(project_instance), "get_settings",
                        lambda self, key: {"num_submit_workers": 4} if key == "sensors" else settings(self, key))
    assert pool_warning(project_instance) is None  # the sensor daemon's workers run only with its threads
    monkeypatch.setattr(type(project_instance), "get_settings", lambda self, key: (
        {"num_submit_workers": 4, "use_threads": True} if key == "sensors" else settings(self, key)))
    assert "sensors set num_submit_workers" in pool_warning(project_instance)


class _Kafka:
    """The KafkaResource's part that the lag report uses: two streams' topics, commits recorded."""

    commit_offsets = True
    streams = {A0[0]: "entity-batches", B0[0]: "connections"}

    def __init__(self):
        self.commits, self.refusal = [], None

    def input_stream(self, topic):
        from types import SimpleNamespace

        return SimpleNamespace(name=self.streams[topic]) if topic in self.streams else None

    def commit(self, positions):
        self.commits.append(dict(positions))
        if self.refusal is not None:
            raise self.refusal
        return "entity-assets-slices"


class _Store:
    engine = None

    def __init__(self, *manifests):
        self.manifests = {m.seq: m for m in manifests}

    def get(self, seq):
        return self.manifests[seq]


def _lag_case(monkeypatch):
    """Slice 1 done, closed 3 hours ago (a quiet night); slice 2 closed 2 s ago, not done; a topic
    the manifests name that the broker no longer lists."""
    from entity_assets import sensors

    done, looks = [1], []
    monkeypatch.setattr(sensors, "lake_holds", lambda engine, newest=max: looks.append(newest) or done[0])
    now = int(time.time() * 1000)
    store = _Store(Manifest(1, (OffsetRange(A0[0], 0, 0, 10), OffsetRange(B0[0], 0, 0, 4),
                                OffsetRange("gone", 0, 0, 3)), now - 3 * 3600 * 1000),
                   Manifest(2, (OffsetRange(A0[0], 0, 10, 12), OffsetRange(B0[0], 0, 4, 4),
                                OffsetRange("gone", 0, 3, 3)), now - 2000))
    return sensors, done, looks, store, {(A0[0], 0): (0, 12), (B0[0], 0): (0, 4)}


def _observed(observations) -> dict[str, dict]:
    return {o.asset_key.path[-1]: {k: v.value for k, v in o.metadata.items()} for o in observations}


def test_the_lag_report_looks_when_slices_change_and_commits_what_kafka_lists(monkeypatch):
    from dagster import DagsterInstance, DagsterRun, DagsterRunStatus

    sensors, done, looks, store, marks = _lag_case(monkeypatch)
    kafka, warned, instance = _Kafka(), [], DagsterInstance.ephemeral()
    observations, state = sensors.report_lag(warned.append, instance, kafka, store, marks, 2, None)
    seen = _observed(observations)
    assert seen["entity-batches"]["lag"] == 2 and 0 < seen["entity-batches"]["seconds_behind"] < 60  # not 3 h
    assert seen["connections"] == {"lag": 0, "seconds_behind": 0.0, "slices_not_done": 1,
                                   "last_slice_done": slice_key(1)}
    assert kafka.commits == [{(A0[0], 0): 10, (B0[0], 0): 4}] and warned == []  # not the topic gone

    # nothing changed, a run of another job succeeded: no look (no state table read)
    instance.add_run(DagsterRun(job_name="lake_maintenance", run_id="00000000-0000-4000-8000-000000000001",
                                status=DagsterRunStatus.SUCCESS))
    assert sensors.report_lag(warned.append, instance, kafka, store, marks, 2, state)[0] == [] and len(looks) == 1
    # a slice's run succeeded: a look, slice 2 done, caught up, committed
    done[0] = 2
    instance.add_run(DagsterRun(job_name="slice_job", run_id="00000000-0000-4000-8000-000000000002",
                                status=DagsterRunStatus.SUCCESS, tags={sensors.PARTITION_TAG: slice_key(2)}))
    observations, state = sensors.report_lag(warned.append, instance, kafka, store, marks, 2, state)
    assert {s: o["lag"] for s, o in _observed(observations).items()} == {"entity-batches": 0, "connections": 0}
    assert kafka.commits[-1] == {(A0[0], 0): 12, (B0[0], 0): 4} and len(looks) == 2
    monkeypatch.setattr(sensors, "LAG_EVERY", 0)
    assert sensors.report_lag(warned.append, instance, kafka, store, marks, 2, state)[0] == []  # caught up, as it was
    assert len(kafka.commits) == 2


def test_a_stream_whose_topics_are_gone_is_observed_at_0_and_a_failed_commit_is_tried_again(monkeypatch):
    from dagster import DagsterInstance

    sensors, done, looks, store, marks = _lag_case(monkeypatch)
    kafka, warned, instance = _Kafka(), [], DagsterInstance.ephemeral()
    kafka.refusal = ValueError("'group_id' cannot be empty")  # what confluent-kafka raises for group.id=
    observations, state = sensors.report_lag(warned.append, instance, kafka, store, marks, 2, None)
    assert _observed(observations)["entity-batches"]["lag"] == 2  # reported all the same
    assert len(warned) == 1 and "'group_id' cannot be empty" in warned[0]
    monkeypatch.setattr(sensors, "LAG_EVERY", 0)
    kafka.refusal = None
    observations, state = sensors.report_lag(warned.append, instance, kafka, store, {(B0[0], 0): (0, 4)}, 2, state)
    assert _observed(observations)["entity-batches"] == {"lag": 0, "seconds_behind": 0.0, "slices_not_done": 1,
                                                        "last_slice_done": slice_key(1)}
    assert len(kafka.commits) == 2 and kafka.commits[-1] == {(B0[0], 0): 4}  # tried again, and done


def test_a_lag_report_that_fails_waits_for_the_next_look_as_a_report_does(monkeypatch):
    from dagster import DagsterInstance

    sensors, done, looks, store, marks = _lag_case(monkeypatch)
    warned, instance = [], DagsterInstance.ephemeral()
    monkeypatch.setattr(sensors, "read_to", lambda *a: 1 / 0)
    assert sensors.report_lag(warned.append, instance, _Kafka(), store, marks, 2, None)[0] == []
    state = sensors.report_lag(warned.append, instance, _Kafka(), store, marks, 2, None)[1]
    for _ in range(3):  # not at every tick
        assert sensors.report_lag(warned.append, instance, _Kafka(), store, marks, 2, state) == ([], state)
    assert len(warned) == 2 and warned[0].startswith("lag not reported: ZeroDivisionError")


def test_a_trail_shown_in_a_run_lists_some_rows_of_each_table_and_says_how_many_more():
    """A batch of thousands of entities in a zone many devices watch: the CLI lists every row,
    a trace run (the UI's event log) the first ones."""
    from entity_assets.trace import Trail, format_trail

    rows = [{"device": f"d{i}", "notification": f"n{i}", "action": "created"} for i in range(60)]
    inboxes = [{"device": f"d{i}", "notifications": [f"n{i}"], "unacknowledged": [], "count_after_slice": 1,
                "count_now": 0} for i in range(60)]
    trail = Trail("t", 0, 7, "0000000001", rows={"changes_by_device": rows}, inboxes=inboxes)
    assert len(format_trail(trail).splitlines()) == 1 + 60 + 60
    shown = format_trail(trail, shown=50).splitlines()
    assert len(shown) == 1 + 51 + 51 and shown[51].endswith("... 10 more (entity-assets trace lists them all)")
