"""Lake maintenance through Dagster: vacuum deletes replaced and orphaned files, never live ones (no Spark)."""

import os
import time

import pytest
from dagster import DagsterEventType
from deltalake import DeltaTable

from entity_assets.definitions import defs
from entity_assets.maintenance import ASSET_TABLES, lake_maintenance
from entity_assets.storage import DeltaRsEngine, FileWriter
from entity_assets.tables import SCHEMAS
from resources import LakeResource


def _write(engine: DeltaRsEngine, table: str, slice_key: str, n: int):
    engine.ensure(table, SCHEMAS[table])
    writer = FileWriter(table, engine.uri(table), SCHEMAS[table], slice_key)
    for i in range(n):
        writer.append({"slice": slice_key, "stream": "entity-batches", "code": "GENERR001", "reason": "r",
                       "kafka_topic": "t", "kafka_partition": 0, "kafka_offset": i, "kafka_timestamp": 1})
    return writer.close()


def _parquet(engine: DeltaRsEngine, table: str) -> set[str]:
    return {f for f in os.listdir(engine.uri(table)) if f.endswith(".parquet")}


def _commit_slice(engine: DeltaRsEngine, seq: int) -> None:
    """Slice `seq`'s one dead letter, as its ingest commits it."""
    key = f"{seq:010d}"
    engine.replace_slice("dead_letters", SCHEMAS["dead_letters"], _write(engine, "dead_letters", key, 1), key)


def test_vacuum_keeps_the_snapshot_and_deletes_what_no_version_needs(tmp_path):
    engine = DeltaRsEngine(str(tmp_path))
    engine.replace_slice("dead_letters", SCHEMAS["dead_letters"], _write(engine, "dead_letters", "0000000001", 3),
                         "0000000001")
    # a re-run of the slice replaces its file; a failed task's file was never committed
    engine.replace_slice("dead_letters", SCHEMAS["dead_letters"],
                                _write(engine, "dead_letters", "0000000001", 2), "0000000001")
    orphan = _write(engine, "dead_letters", "0000000002", 1)[0].path
    assert len(_parquet(engine, "dead_letters")) == 3
    spool = tmp_path / "_outbox" / "failed-publish.spool"  # a step failed between its commit and its publish
    spool.parent.mkdir()
    spool.write_bytes(b"records")
    live = {f.path for f in engine.files("dead_letters")}

    result = lake_maintenance.execute_in_process(
        resources={"lake": LakeResource(root=str(tmp_path), vacuum_retention_hours=0)})
    assert result.success

    kept = _parquet(engine, "dead_letters")
    assert kept == live == {f.path for f in engine.files("dead_letters")} and orphan not in kept and len(kept) == 1
    assert engine.read("dead_letters").num_rows == 2
    assert not spool.exists()
    observed = [e.event_specific_data.asset_observation for e in result.all_events
                if e.event_type == DagsterEventType.ASSET_OBSERVATION]
    assert [(o.asset_key.path, o.metadata["vacuumed_files"].value) for o in observed] == [(["dead_letters"], 2)]


def test_the_default_retention_keeps_recent_files(tmp_path):
    engine = DeltaRsEngine(str(tmp_path))
    for n in (3, 2):
        engine.replace_slice("dead_letters", SCHEMAS["dead_letters"], _write(engine, "dead_letters", "0000000001", n),
                             "0000000001")
    _write(engine, "dead_letters", "0000000002", 1)  # as a running slice's task writes before its commit
    (tmp_path / "_outbox").mkdir()
    (tmp_path / "_outbox" / "running.spool").write_bytes(b"records")  # a running step's, not yet published
    assert lake_maintenance.execute_in_process(resources={"lake": LakeResource(root=str(tmp_path))}).success
    assert len(_parquet(engine, "dead_letters")) == 3  # replaced or written a moment ago: all kept
    assert (tmp_path / "_outbox" / "running.spool").exists()


def test_a_retention_past_delta_s_seven_days_keeps_the_files_its_versions_name(tmp_path, monkeypatch):
    """A file written 40 days ago and replaced 10 days ago, with a checkpoint since: at a 30-day
    retention a replay of 10 days ago still reads it, so the vacuum must keep it (a checkpoint
    at Delta's default drops the record of its removal after 7 days)."""
    from entity_assets import storage

    engine, day, now = DeltaRsEngine(str(tmp_path)), 86_400, time.time()
    engine.replace_slice("dead_letters", SCHEMAS["dead_letters"], _write(engine, "dead_letters", "0000000001", 1),
                         "0000000001")
    engine.vacuum("dead_letters", 720)  # the first maintenance at the raised retention
    [old] = _parquet(engine, "dead_letters")
    os.utime(engine.uri("dead_letters") + "/" + old, (now - 40 * day, now - 40 * day))
    with monkeypatch.context() as ago:
        ago.setattr(storage.time, "time", lambda: now - 10 * day)
        engine.replace_slice("dead_letters", SCHEMAS["dead_letters"], _write(engine, "dead_letters", "0000000001", 2),
                             "0000000001")
    DeltaTable(engine.uri("dead_letters")).create_checkpoint()
    engine.vacuum("dead_letters", 720)
    assert old in _parquet(engine, "dead_letters")
    assert DeltaTable(engine.uri("dead_letters")).metadata().configuration[
        storage.DELETED_FILE_RETENTION_SETTING] == "interval 720 hours"


def test_the_vacuum_keeps_what_a_replay_of_the_last_slice_reads_however_long_the_lake_was_idle(tmp_path):
    """Slice 2 replaced slice 1's state, and no slice came since (its publish failed, say): a
    re-run of slice 2 reads the state as of slice 1, whose file the vacuum keeps, as the log
    keeps its commit, past the retention (here none, for a lake idle longer than it)."""
    engine = DeltaRsEngine(str(tmp_path))
    engine.replace_slice("dead_letters", SCHEMAS["dead_letters"], _write(engine, "dead_letters", "0000000001", 1),
                         "0000000001")
    [first] = _parquet(engine, "dead_letters")
    engine.commit("dead_letters", SCHEMAS["dead_letters"], add=_write(engine, "dead_letters", "0000000002", 2),
                  remove=engine.files("dead_letters"), operation="apply", slice_key="0000000002")
    engine.vacuum("dead_letters", 0)
    assert first in _parquet(engine, "dead_letters")
    assert engine.missing("dead_letters", engine.files("dead_letters", 1)) == []


def test_a_raised_retention_keeps_what_a_replay_reads_after_a_checkpoint_dropped_its_removal(tmp_path, monkeypatch):
    """Slice 3 removed slice 2's file three days ago, under a 24-hour retention whose checkpoint
    dropped the record of that removal; the retention is then raised to a week. The file's
    removal is younger than the week, yet the vacuum finds no record of it: only the replay base
    (slice 2's version) keeps it."""
    from entity_assets import storage

    engine, hour, now = DeltaRsEngine(str(tmp_path)), 3600, time.time()
    with monkeypatch.context() as ago:
        ago.setattr(storage.time, "time", lambda: now - 30 * 24 * hour)
        _commit_slice(engine, 1)
        _commit_slice(engine, 2)
    old = _parquet(engine, "dead_letters")
    for name in old:
        os.utime(engine.uri("dead_letters") + "/" + name, (now - 30 * 24 * hour,) * 2)
    with monkeypatch.context() as ago:
        ago.setattr(storage.time, "time", lambda: now - 72 * hour)
        engine.commit("dead_letters", SCHEMAS["dead_letters"], add=_write(engine, "dead_letters", "0000000003", 1),
                      remove=engine.files("dead_letters"), operation="apply", slice_key="0000000003")
    engine.vacuum("dead_letters", 24)
    DeltaTable(engine.uri("dead_letters")).create_checkpoint()
    engine.vacuum("dead_letters", 168)
    base = [v for v in range(engine.version("dead_letters")) if {f.path for f in engine.files("dead_letters", v)} == old]
    assert base and engine.missing("dead_letters", engine.files("dead_letters", base[-1])) == []


def test_a_vacuum_that_deletes_files_leaves_the_log_a_replay_of_the_last_slice_needs(tmp_path):
    """An idle lake whose log retention has passed, with a checkpoint after the replay base
    (slice 2's commit): `expire_log` keeps the log. A vacuum that deleted a file used to commit,
    and that commit's hook expired the log anyway, slice 2's commit with it: a re-run of slice 3
    could not be replayed, and slice 3's own publish mark could go."""
    engine = DeltaRsEngine(str(tmp_path))
    for seq in (1, 2, 3):
        _commit_slice(engine, seq)
    DeltaTable(engine.uri("dead_letters")).create_checkpoint()  # as an idle lake's maintenance commits make one
    assert engine.expire_log("dead_letters", 0) == 0
    orphan = _write(engine, "dead_letters", "0000000004", 1)[0].path  # a failed retry's
    assert engine.vacuum("dead_letters", 0) == [orphan]
    assert engine.version_after("dead_letters", "0000000002", "replace_slice") == 2
    assert engine.vacuum("dead_letters", 0) == []  # what an earlier vacuum deleted is not counted again


def test_a_busy_lake_is_vacuumed_by_one_listing_of_its_files(tmp_path, monkeypatch):
    """The vacuum lists once (a dry run, whose files the engine deletes) and deletes a failed
    run's old file."""
    engine, now = DeltaRsEngine(str(tmp_path)), time.time()
    for seq in (1, 2):
        _commit_slice(engine, seq)
    orphan = _write(engine, "dead_letters", "0000000003", 1)[0].path  # a failed run's, 3 hours ago
    os.utime(engine.uri("dead_letters") + "/" + orphan, (now - 10_800, now - 10_800))
    live, runs = _parquet(engine, "dead_letters") - {orphan}, []
    vacuum = DeltaTable.vacuum
    monkeypatch.setattr(DeltaTable, "vacuum", lambda self, **kw: runs.append(kw["dry_run"]) or vacuum(self, **kw))
    assert engine.vacuum("dead_letters", 2) == [orphan]
    assert runs == [True] and _parquet(engine, "dead_letters") == live


def test_observed_tables_are_the_graphs_assets():
    assets = {key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()}
    assert ASSET_TABLES <= assets
    assert not (set(SCHEMAS) - ASSET_TABLES) & assets
    assert defs.resolve_schedule_def("lake_maintenance_schedule").job_name == "lake_maintenance"


def test_commits_leave_expired_log_files_to_maintenance_at_the_vacuum_retention(tmp_path):
    from deltalake import DeltaTable

    engine = DeltaRsEngine(str(tmp_path))
    for seq in range(1, 13):  # a checkpoint at version 9, the tenth commit
        _commit_slice(engine, seq)
    log = tmp_path / "dead_letters" / "_delta_log"
    assert (log / f"{0:020d}.json").exists() and (log / f"{9:020d}.checkpoint.parquet").exists()

    def maintain(hours: int) -> int:
        result = lake_maintenance.execute_in_process(
            resources={"lake": LakeResource(root=str(tmp_path), vacuum_retention_hours=hours)})
        assert result.success
        [observed] = [e.event_specific_data.asset_observation for e in result.all_events
                      if e.event_type == DagsterEventType.ASSET_OBSERVATION]
        return observed.metadata["expired_log_files"].value

    # the log retention follows the vacuum's, as a table property that other Delta engines honour
    assert maintain(168) == 0 and (log / f"{0:020d}.json").exists()
    assert DeltaTable(engine.uri("dead_letters")).metadata().configuration["delta.logRetentionDuration"] == (
        "interval 168 hours")
    assert maintain(0) == 9  # versions 0-8, before the checkpoint (versions 13 and 14 set the two retentions)
    assert not (log / f"{0:020d}.json").exists() and (log / f"{14:020d}.json").exists()
    assert engine.read("dead_letters").num_rows == 12  # the latest version opens from its checkpoint


def test_the_log_keeps_the_commit_of_a_table_s_last_slice_which_the_next_slice_looks_for(tmp_path):
    from deltalake import DeltaTable

    engine = DeltaRsEngine(str(tmp_path))

    for seq in (1, 2):
        _commit_slice(engine, seq)
    assert engine.expire_log("dead_letters", 0) == 0  # version 3 sets the retention; no checkpoint yet
    DeltaTable(engine.uri("dead_letters")).create_checkpoint()  # as an idle lake's maintenance commits make one
    _commit_slice(engine, 1)  # version 4: a re-run of slice 1, after the checkpoint
    assert engine.expire_log("dead_letters", 0) == 0
    assert engine.version_after("dead_letters", "0000000002", "replace_slice") == 2

    _commit_slice(engine, 3)
    assert engine.expire_log("dead_letters", 0) == 0  # a replay of slice 3 reads the version slice 2 left
    assert engine.version_after("dead_letters", "0000000002", "replace_slice") == 2
    _commit_slice(engine, 4)
    assert engine.expire_log("dead_letters", 0) == 3  # versions 0-2, before the checkpoint
    assert engine.version_after("dead_letters", "0000000002", "replace_slice") is None
    assert engine.version_after("dead_letters", "0000000003", "replace_slice") == 5
    assert engine.read("dead_letters").num_rows == 4
    # a re-run of slice 3 (or a rebuild) finds slice 2 done: the log no longer reaches back to it
    assert engine.reached("dead_letters", "0000000002", "replace_slice")
    assert engine.reached("dead_letters", "0000000001", "replace_slice")  # slice 1's re-run, version 4, is held
    assert engine.reached("dead_letters", "0000000004", "replace_slice")
    assert not engine.reached("dead_letters", "0000000005", "replace_slice")
    assert not engine.reached("dead_letters", "0000000002", "apply")
    # while the log is whole, a later slice's commit does not stand for an earlier one's
    other = DeltaRsEngine(str(tmp_path / "other"))
    other.replace_slice("dead_letters", SCHEMAS["dead_letters"], _write(other, "dead_letters", "0000000002", 1),
                        "0000000002")
    assert not other.reached("dead_letters", "0000000001", "replace_slice")


def test_a_slice_that_never_succeeded_is_not_taken_as_done_once_the_log_is_trimmed(tmp_path):
    """Slice 4 failed while slices 3 and 5 went on: after the log lost the commits of slices 1
    and 2, a later slice's commit must not stand for slice 4's, which the guards of the steps
    after it (redeliveries, inputs, publish order) ask for."""
    from deltalake import DeltaTable

    engine = DeltaRsEngine(str(tmp_path))

    for seq in (1, 2):
        _commit_slice(engine, seq)
    engine.expire_log("dead_letters", 0)
    DeltaTable(engine.uri("dead_letters")).create_checkpoint()
    _commit_slice(engine, 3)
    _commit_slice(engine, 5)
    assert engine.expire_log("dead_letters", 0) > 0
    assert engine.version_after("dead_letters", "0000000001", "replace_slice") is None
    assert [engine.reached("dead_letters", f"{seq:010d}", "replace_slice") for seq in range(1, 7)] == [
        True, True, True, False, True, False]
    assert not engine.reached("dead_letters", "0000000001", "apply")
    # the next trim keeps what this one recorded, and adds slice 5
    DeltaTable(engine.uri("dead_letters")).create_checkpoint()
    engine.expire_log("dead_letters", 0)
    assert DeltaTable(engine.uri("dead_letters")).metadata().configuration[
        "entity_assets.slicesDone.replace_slice"] == "1-3,5"
    assert [engine.reached("dead_letters", f"{seq:010d}", "replace_slice") for seq in range(1, 7)] == [
        True, True, True, False, True, False]


def test_a_step_that_reads_a_state_as_of_its_slice_says_why_it_cannot(tmp_path):
    """changes_by_device and learn_schemas read entities and schemas as of their slice: a slice
    not applied yet, and one whose version lake_maintenance expired, are refused, each saying so
    (the expired one once read the newest schemas instead, and the other asked to run the step
    that had run)."""
    from deltalake import DeltaTable

    from entity_assets.assets.common import OutOfOrder, applied_version, commit_state

    engine = DeltaRsEngine(str(tmp_path))
    engine.ensure("schemas", SCHEMAS["schemas"])
    for seq in (1, 2):
        commit_state(engine, "schemas", f"{seq:010d}", [], [])
    engine.expire_log("schemas", 0)
    DeltaTable(engine.uri("schemas")).create_checkpoint()
    third = commit_state(engine, "schemas", "0000000003", [], [])
    commit_state(engine, "schemas", "0000000004", [], [])  # the log keeps the last two slices' commits
    assert engine.expire_log("schemas", 0) > 0
    assert applied_version(engine, "schemas", "0000000003", "learn_schemas") == third
    with pytest.raises(OutOfOrder, match="slice 0000000001 cannot be run again: learn_schemas reads schemas as of "
                                         "the slice, a version that lake_maintenance has expired"):
        applied_version(engine, "schemas", "0000000001", "learn_schemas")
    with pytest.raises(OutOfOrder, match="slice 0000000005: schemas has no state of it yet"):
        applied_version(engine, "schemas", "0000000005", "learn_schemas")


def test_a_state_version_whose_files_were_vacuumed_is_refused_not_read(tmp_path):
    """The log keeps old commits its checkpoint needs after the vacuum deleted their files: a
    step reading the state as of such a slice once failed on a missing file."""
    from entity_assets.assets.common import OutOfOrder, applied_version, commit_state

    engine = DeltaRsEngine(str(tmp_path))
    for seq in (1, 2, 3, 4):
        key = f"{seq:010d}"
        commit_state(engine, "dead_letters", key, _write(engine, "dead_letters", key, 1), engine.files("dead_letters"))
    engine.vacuum("dead_letters", 0)  # keeps slice 3's files (the replay base) and slice 4's
    assert applied_version(engine, "dead_letters", "0000000003", "changes_by_device") == 3
    with pytest.raises(OutOfOrder, match="slice 0000000002 cannot be run again: changes_by_device reads dead_letters"):
        applied_version(engine, "dead_letters", "0000000002", "changes_by_device")


def test_a_log_an_older_release_trimmed_takes_what_it_lost_as_done(tmp_path):
    from deltalake import DeltaTable

    engine = DeltaRsEngine(str(tmp_path))
    for seq in (1, 2, 3):
        _commit_slice(engine, seq)
    table = DeltaTable(engine.uri("dead_letters"))
    table.alter.set_table_properties({"delta.logRetentionDuration": "interval 0 hours"})
    table.create_checkpoint()
    table.cleanup_metadata()  # as that release's expire_log did, recording nothing
    for seq in (4, 5, 2):  # slice 2 ran again after the trim: the log's lowest slice is not where it cut
        _commit_slice(engine, seq)
    assert engine.version_after("dead_letters", "0000000003", "replace_slice") is None
    assert engine.reached("dead_letters", "0000000003", "replace_slice")
    # records the slices before the oldest commit the log holds, where the trim cut, and those it holds
    engine.expire_log("dead_letters", 0)
    assert DeltaTable(engine.uri("dead_letters")).metadata().configuration[
        "entity_assets.slicesDone.replace_slice"] == "1-5"


def test_older_slices_run_again_in_a_row_after_the_log_was_trimmed(tmp_path):
    """The rebuild operations.md describes (a state deleted, `run --slices 1..N`): each older
    slice's re-run records no publish, as later slices have published, and the original records
    have left the log; the slice after it must still run."""
    from deltalake import DeltaTable

    from entity_assets.assets.common import PUBLISH, record_published, require_published

    engine, table = DeltaRsEngine(str(tmp_path)), "dead_letters"

    def run(seq: int) -> None:
        require_published(engine, table, f"{seq:010d}")
        _commit_slice(engine, seq)
        record_published(engine, table, f"{seq:010d}")

    for seq in range(1, 13):
        run(seq)
    DeltaTable(engine.uri(table)).create_checkpoint()
    last, trimmed = 12, 0
    while not trimmed and last < 40:  # until no checkpoint follows the last two slices' commits, which the log keeps
        last += 1
        run(last)
        trimmed = engine.expire_log(table, 0)
    assert trimmed and engine.version_after(table, "0000000001", PUBLISH) is None
    for seq in (1, 2, 3):
        run(seq)
    assert engine.version_after(table, "0000000002", PUBLISH) is None  # no publish recorded by the re-runs
    assert next(engine.slices_done(table, PUBLISH)) == f"{last:010d}"


def test_a_stream_publishes_a_slice_after_the_slice_before_unless_the_table_starts_there(tmp_path):
    """`require_published`: what a step checks before it runs, on its stream table's log (and on
    the slice whose run made the table)."""
    from entity_assets.assets.common import OutOfOrder, record_published, require_published

    engine, table = DeltaRsEngine(str(tmp_path)), "dead_letters"
    engine.ensure(table, SCHEMAS[table])

    def key(seq: int) -> str:
        return f"{seq:010d}"

    require_published(engine, table, key(3))  # a new table (or one rebuilt from here): nothing to follow
    engine.replace_slice(table, SCHEMAS[table], [], key(3))
    with pytest.raises(OutOfOrder, match=f"messages of slice {key(3)} are not published"):
        require_published(engine, table, key(4))  # written, then its publishing failed
    record_published(engine, table, key(3))
    require_published(engine, table, key(4))
    engine.replace_slice(table, SCHEMAS[table], [], key(4))
    record_published(engine, table, key(4))
    with pytest.raises(OutOfOrder, match=f"slice {key(5)}"):
        require_published(engine, table, key(6))  # slice 5 never ran here
    # a slice an older release wrote records no publish: taken as published
    engine.commit(table, SCHEMAS[table], add=[], operation="replace_slice", slice_key=key(7))
    require_published(engine, table, key(8))
    # a table the run of its first slice made, which failed before its commit: not one that starts later
    made = DeltaRsEngine(str(tmp_path / "made"))
    made.ensure(table, SCHEMAS[table], slice_key=key(1))
    with pytest.raises(OutOfOrder, match=f"messages of slice {key(1)} are not published"):
        require_published(made, table, key(2))
    made.ensure("zone_changes", SCHEMAS["zone_changes"], slice_key=key(2))  # new in the release slice 2 ran
    require_published(made, "zone_changes", key(2))


def test_a_stream_table_deleted_and_rebuilt_from_slice_1_publishes_only_the_slices_after(tmp_path):
    """The highest slice published is a note of the lake as well as a commit of the stream's
    table: a table deleted to be rebuilt (the remedy of a layout error) once sent every change,
    response and notification of its history again."""
    import logging
    import shutil
    from types import SimpleNamespace

    from entity_assets.assets.common import publishes_slice, record_published, require_published

    engine, table = DeltaRsEngine(str(tmp_path)), "dead_letters"
    context = SimpleNamespace(run=SimpleNamespace(tags={}), log=logging.getLogger("test"))
    keys = [f"{seq:010d}" for seq in range(1, 5)]
    engine.ensure(table, SCHEMAS[table])
    for key in keys[:3]:
        assert publishes_slice(context, engine, table, key)
        engine.replace_slice(table, SCHEMAS[table], [], key)
        record_published(engine, table, key)
    # a step retried after its publish (a read of the lake that failed) sends the slice's messages once
    assert not publishes_slice(context, engine, table, keys[2])
    assert publishes_slice(SimpleNamespace(run=SimpleNamespace(tags={"entity_assets/republish": "true"}),
                                           log=context.log), engine, table, keys[2])  # unless told to
    shutil.rmtree(engine.uri(table))
    engine = DeltaRsEngine(str(tmp_path))
    engine.ensure(table, SCHEMAS[table])
    for key in keys[:3]:  # the rebuild, its newest slice too: the lake's note says it was published
        require_published(engine, table, key)
        assert not publishes_slice(context, engine, table, key)
        engine.replace_slice(table, SCHEMAS[table], [], key)
        record_published(engine, table, key)
    require_published(engine, table, keys[3])
    assert publishes_slice(context, engine, table, keys[3])  # the first slice after the history
    # a lake of a release before the note: the first look at the table notes what its log says
    shutil.rmtree(tmp_path / "_notes")
    assert not publishes_slice(context, engine, table, keys[1]) and engine.read_note(f"published-{table}") == keys[2]
    context.run.tags["entity_assets/republish"] = "true"
    assert publishes_slice(context, engine, table, keys[0])  # told to


def test_maintenance_leaves_the_manifests_properties_as_they_are_once_set(tmp_path):
    """The sensor commits manifests outside the lake pool: a daily property commit (the slices
    done, which no step asks of the manifests) could meet one and fail the tick or the maintenance."""
    from entity_assets import storage
    from entity_assets.manifests import TABLE, ManifestStore
    from entity_assets.slices import Manifest, OffsetRange

    engine = DeltaRsEngine(str(tmp_path))
    store = ManifestStore(engine)

    def maintain() -> int:
        assert lake_maintenance.execute_in_process(resources={"lake": LakeResource(root=str(tmp_path))}).success
        return DeltaTable(engine.uri(TABLE)).version()

    store.write(Manifest(1, (OffsetRange("entity-batches", 0, 0, 5),), 1))
    first = maintain()
    store.write(Manifest(2, (OffsetRange("entity-batches", 0, 5, 9),), 2))
    assert maintain() == first + 1  # the manifest's commit only
    assert not [name for name in DeltaTable(engine.uri(TABLE)).metadata().configuration
                if name.startswith(storage.DONE_PROPERTY)]


def test_a_vacuum_leaves_a_manifest_the_sensor_is_committing(tmp_path):
    """A manifest's file is written before its commit, outside the lake pool: a vacuum at a
    retention of 0 between the two made the slice unreadable for good."""
    from entity_assets.manifests import TABLE, ManifestStore
    from entity_assets.slices import Manifest, OffsetRange

    engine = DeltaRsEngine(str(tmp_path))
    ManifestStore(engine).write(Manifest(1, (OffsetRange("entity-batches", 0, 0, 5),), 1))
    writing = os.path.join(engine.uri(TABLE), "part-00001-being-committed.parquet")
    with open(writing, "wb") as f:
        f.write(b"PAR1")
    assert lake_maintenance.execute_in_process(
        resources={"lake": LakeResource(root=str(tmp_path), vacuum_retention_hours=0)}).success
    assert os.path.exists(writing)


def test_a_run_whose_resource_differs_from_the_environment_is_refused(tmp_path, monkeypatch):
    """A run config that sets one field of a resource makes Dagster drop the deployment's other
    fields that have a fixed default: here the retention, which would fall back to 7 days."""
    from entity_assets.definitions import build_resources

    deployed = DeltaRsEngine(str(tmp_path / "deployed"))
    for n in (3, 2):
        deployed.replace_slice("dead_letters", SCHEMAS["dead_letters"], _write(deployed, "dead_letters", "0000000001", n),
                               "0000000001")
    failed = os.path.join(deployed.uri("dead_letters"), _write(deployed, "dead_letters", "0000000002", 1)[0].path)
    os.utime(failed, (time.time() - 2 * 3600,) * 2)  # a failed run's file, two hours old
    monkeypatch.setenv("ENTITY_ASSETS_LAKE", str(tmp_path / "deployed"))
    monkeypatch.setenv("ENTITY_ASSETS_VACUUM_RETENTION_HOURS", "1")
    lake = build_resources()["lake"]
    result = lake_maintenance.execute_in_process(run_config={"resources": {"lake": {"config": {"state_file_rows": 99}}}},
                                                 resources={"lake": lake}, raise_on_error=False)
    assert not result.success
    said = str(result.all_events)
    assert "lake.vacuum_retention_hours is 168, where ENTITY_ASSETS_VACUUM_RETENTION_HOURS sets it" in said
    assert len(_parquet(deployed, "dead_letters")) == 3  # nothing vacuumed
    # the deployment's settings: the run goes
    assert lake_maintenance.execute_in_process(resources={"lake": lake}).success
    assert len(_parquet(deployed, "dead_letters")) == 2 and not os.path.exists(failed)
