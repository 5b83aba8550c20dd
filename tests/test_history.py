"""An entity's history replayed from its updates: versions, validity, reads as of a slice or a time."""

import pyarrow as pa
import pytest

from entity_assets import core
from entity_assets.assets.common import ensure_tables
from entity_assets.history import Diverged, as_of, entity_history, versions
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


def test_a_history_reads_the_files_of_entity_updates_from_before_and_after_its_bucket_column(tmp_path):
    engine, table = DeltaRsEngine(str(tmp_path)), "entity_updates"
    key = ("db", "people", "z", "ann")
    old = pa.schema([f for f in SCHEMAS[table] if f.name != "bucket"])  # a lake of an older release
    engine.ensure(table, old)

    def commit(schema, slice_, *updates):
        writer = FileWriter(table, engine.uri(table), schema, slice_)
        for u in updates:
            writer.append({**u, **dict(zip(core.ENTITY_KEY, key)), "bucket": core.bucket_of(*key)})
        engine.commit(table, schema, add=writer.close(), operation="test", slice_key=slice_)

    commit(old, "0000000001", CREATE, RENAME)
    ensure_tables(engine, [table])  # the next slice's step adds the column: one commit, no rebuild
    assert "bucket" in engine.read(table).column_names and engine.read(table).column("bucket").null_count == 2
    commit(SCHEMAS[table], "0000000002", DELETE)
    commit(SCHEMAS[table], "0000000003", RECREATE)
    history = entity_history(engine, *key)
    assert [(v["version"], v["action"], v["slice"]) for v in history] == [
        (1, "created", "0000000001"), (2, "updated", "0000000001"), (3, "deleted", "0000000002"),
        (4, "created", "0000000003")]
    assert entity_history(engine, "db", "people", "z", "bob") == []
