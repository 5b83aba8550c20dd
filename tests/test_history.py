"""An entity's history replayed from its updates: versions, validity, reads as of a slice or a time."""

import functools

import pyarrow as pa
import pytest

from entity_assets import cli, core
from entity_assets.assets.common import ensure_tables
from entity_assets.history import Diverged, as_of, entity_history, versions
from entity_assets.manifests import ManifestStore
from entity_assets.slices import Manifest, OffsetRange
from entity_assets.storage import DeltaRsEngine, FileWriter
from entity_assets.tables import SCHEMAS


def update(slice_: str, begun: int, request: int, ops: list[dict], action: str, ended: int | None = None) -> dict:
    return {"slice": slice_, "kafka_topic": "entity-batches", "kafka_partition": 0, "kafka_offset": request,
            "begun": begun, "clientid": "c", "request": request, "part": 1, "ended": ended or begun,
            "ops": core.dumps(ops), "action": action}


CREATE = update("0000000001", 100, 1, [{"op": "add", "path": "name", "value": "Ann"}], "created")
RENAME = update("0000000001", 200, 2, [{"op": "replace", "path": "name", "value": "Bea"}], "updated")
DELETE = update("0000000002", 300, 3, [{"op": "remove", "path": ""}], "deleted")
# arrived in slice 3, but began before the deletion: applied after it all the same (slice order)
RECREATE = update("0000000003", 250, 4, [{"op": "add", "path": "", "value": {"name": "Cy"}}], "created")


def test_versions_replay_the_updates_in_slice_then_begun_order():
    history = versions([RECREATE, DELETE, RENAME, CREATE])  # any order in
    assert [(v["version"], v["action"], v["deleted"], v["document"]) for v in history] == [
        (1, "created", False, {"name": "Ann"}), (2, "updated", False, {"name": "Bea"}),
        (3, "deleted", True, None), (4, "created", False, {"name": "Cy"})]
    assert [(v["request"], v["slice"], v["kafka_offset"]) for v in history] == [
        (1, "0000000001", 1), (2, "0000000001", 2), (3, "0000000002", 3), (4, "0000000003", 4)]


def test_a_version_is_valid_from_when_every_change_it_holds_had_ended_to_the_next_version():
    history = versions([CREATE, RENAME, DELETE, RECREATE])
    # the re-creation ended at 250, but holds the deletion, which ended at 300
    assert [(v["valid_from"], v["valid_to"], v["ended"]) for v in history] == [
        (100, 200, 100), (200, 300, 200), (300, 300, 300), (300, None, 250)]


def test_as_of_a_slice_or_a_time():
    history = versions([CREATE, RENAME, DELETE, RECREATE])
    assert as_of(history, slice=1)["document"] == {"name": "Bea"}
    assert as_of(history, slice=2)["deleted"] is True
    assert as_of(history, slice=9)["document"] == {"name": "Cy"}
    assert as_of(history, slice=0) is None
    assert as_of(history, time=99) is None
    assert as_of(history, time=100)["document"] == {"name": "Ann"}
    assert as_of(history, time=299)["document"] == {"name": "Bea"}
    assert as_of(history, time=300)["version"] == 4  # versions 3 and 4 both start at 300: the later holds
    assert versions([]) == [] and as_of([], time=1) is None


def test_an_update_that_does_not_apply_to_the_version_before_it_says_the_history_is_incomplete():
    with pytest.raises(Diverged, match="c/2/1 of slice 0000000001 gives status 2"):
        versions([RENAME])  # its creation is missing
    with pytest.raises(Diverged, match="action updated"):
        versions([CREATE, {**RENAME, "action": "created"}])


def commit_rows(engine, name, schema, slice_, *rows):
    """A commit of `rows`, (entity key, row) pairs, as a slice's step makes one."""
    writer = FileWriter(name, engine.uri(name), schema, slice_)
    for key, row in rows:
        writer.append({**row, **dict(zip(core.ENTITY_KEY, key)), "bucket": core.bucket_of(*key)})
    engine.commit(name, schema, add=writer.close(), operation="test", slice_key=slice_)


def test_a_history_follows_its_entity_s_slices_back_and_reads_what_came_before_the_index_whole(tmp_path, monkeypatch):
    engine, table = DeltaRsEngine(str(tmp_path)), "entity_updates"
    ann, bob, cy = ("db", "people", "z", "ann"), ("db", "people", "z", "bob"), ("db", "people", "z", "cy")
    index = ("bucket", "previousSlice")
    old = pa.schema([f for f in SCHEMAS[table] if f.name not in index])  # a lake of an older release
    engine.ensure(table, old)
    commit = functools.partial(commit_rows, engine)
    commit(table, old, "0000000001", (ann, CREATE), (ann, RENAME))
    ensure_tables(engine, "0000000002", [table, "entities"])  # the next slice's step adds the columns: one commit, no rebuild
    assert engine.read(table, columns=list(index)).to_pylist() == [{"bucket": None, "previousSlice": None}] * 2
    commit(table, SCHEMAS[table], "0000000002", (ann, {**DELETE, "previousSlice": "0000000001"}),
           (bob, {**CREATE, "slice": "0000000002"}), (cy, {**CREATE, "slice": "0000000002"}))
    commit(table, SCHEMAS[table], "0000000003", (ann, {**RECREATE, "previousSlice": "0000000002"}),
           (cy, {**RENAME, "slice": "0000000003", "previousSlice": "0000000002"}))
    # ann's state row names slice 3, which names 2, which names 1, written before the index: read whole;
    # bob's names slice 4, whose updates are missing (read between the step's commits, or one left out)
    commit("entities", SCHEMAS["entities"], "0000000004", (ann, {"slice": "0000000003", "version": 4}),
           (bob, {"slice": "0000000004", "version": 2}), (cy, {"slice": "0000000003", "version": 2}))
    assert [(v["version"], v["action"], v["slice"]) for v in entity_history(engine, *ann)] == [
        (1, "created", "0000000001"), (2, "updated", "0000000001"), (3, "deleted", "0000000002"),
        (4, "created", "0000000003")]
    with pytest.raises(Diverged, match="entity_updates lacks slice 0000000004's updates of this entity, whose row in "
                       r"entities is version 2 of that slice \(the history replayed ends at version 1\): re-run slice 4"):
        entity_history(engine, *bob)  # not versions 1 of 2 as if they were all
    assert entity_history(engine, "db", "people", "z", "dan") == []
    # a whole chain reads only the slices it names
    every = engine.files
    monkeypatch.setattr(engine, "files", lambda name, *a, **k: pytest.fail("read every slice") if name == table
                        else every(name, *a, **k))
    assert [(v["version"], v["document"], v["slice"]) for v in entity_history(engine, *cy)] == [
        (1, {"name": "Ann"}, "0000000002"), (2, {"name": "Bea"}, "0000000003")]


def test_the_cli_marks_a_version_of_no_length_and_says_a_history_short_of_its_state_on_a_line(tmp_path, monkeypatch,
                                                                                               capsys):
    engine, updates = DeltaRsEngine(str(tmp_path / "lake")), SCHEMAS["entity_updates"]
    for seq in range(1, 5):
        ManifestStore(engine).write(Manifest(seq, (OffsetRange("entity-batches", 0, seq, seq + 1),), seq))
    ensure_tables(engine, "0000000001", ["entity_updates", "entities"])
    ann, bob = ("db", "people", "z", "ann"), ("db", "people", "z", "bob")
    commit_rows(engine, "entity_updates", updates, "0000000001", (ann, CREATE), (ann, RENAME))
    commit_rows(engine, "entity_updates", updates, "0000000002", (ann, {**DELETE, "previousSlice": "0000000001"}),
                (bob, {**CREATE, "slice": "0000000002"}))
    commit_rows(engine, "entity_updates", updates, "0000000003", (ann, {**RECREATE, "previousSlice": "0000000002"}))
    commit_rows(engine, "entities", SCHEMAS["entities"], "0000000004", (ann, {"slice": "0000000003", "version": 4}),
                (bob, {"slice": "0000000004", "version": 2}))  # slice 4's commit of entity_updates not made yet
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("ENTITY_ASSETS_LAKE", engine.root)
    assert cli.main(["history", *ann]) == 0
    # the deletion, of slice 2, is followed by a re-creation that began before it (slice order wins)
    assert [line.split("  ")[2:4] for line in capsys.readouterr().out.splitlines()] == [
        ["valid 100..200", "created by c/1/1"], ["valid 200..300", "updated by c/2/1"],
        ["valid 300..300", "(zero-length: the next update had ended by then)"], ["valid 300..", "created by c/4/1"]]
    assert cli.main(["history", *ann, "--slice", "2"]) == 0 and capsys.readouterr().out == "null\n"
    assert cli.main(["history", *ann, "--at", "300"]) == 0 and capsys.readouterr().out == '{"name": "Cy"}\n'
    with pytest.raises(SystemExit) as stopped:  # its message a line on stderr, its status 1
        cli.main(["history", *bob])
    assert stopped.value.code == ("entity-assets history: entity_updates lacks slice 0000000004's updates of this "
                                  "entity, whose row in entities is version 2 of that slice (the history replayed "
                                  "ends at version 1): re-run slice 4, or read again once its run ended")
