"""The Spark task bodies of the entity core and the zone and device steps, run in this process over
local parquet across two slices: what the steps' tasks do with a slice's rows, in milliseconds
(the Spark and Delta tests check the same through the assets, in minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from entity_assets import core, fold, notify
from entity_assets.storage import TableFile, from_rows
from entity_assets.tables import SCHEMAS

DB = "my-db"
SUBSCRIPTION = "sub-1"


class Lake:
    """A slice's task outputs in a folder of its own; the entity state's files carried from slice to slice."""

    def __init__(self, root: Path):
        self.root, self.state = root, {}
        self.offset = 0

    def uris(self, slice_key: str) -> dict[str, str]:
        """Each table's folder, made as its Delta table would be."""
        for table in SCHEMAS:
            (self.root / slice_key / table).mkdir(parents=True, exist_ok=True)
        return {t: str(self.root / slice_key / t) for t in SCHEMAS}

    def explode(self, slice_key: str, batches: list[dict], redelivered: frozenset = frozenset()):
        """`entity_batches` rows of `batches` (offsets from 0 on, across slices), then the explode task."""
        rows = []
        for b in batches:
            rows.append({"slice": slice_key, "kafka_topic": "entity-batches", "kafka_partition": 0,
                         "kafka_offset": self.offset, "kafka_timestamp": b["begun"] + 1, "clientid": "c1",
                         "request": self.offset, "user": "jsmith", "dbid": DB, "begun": b["begun"],
                         "parts": len(b["patches"]), "patches": json.dumps(b["patches"]),
                         "learning": b.get("learning", False), "includeBefore": False, "includeAfter": True})
            self.offset += 1
        data = from_rows(rows, pa.struct(list(SCHEMAS["entity_batches"])))
        [report] = fold.explode_task(iter([data]), slice_key=slice_key, uris=self.uris(slice_key),
                                     storage_options=None, redelivered=redelivered)
        return report.to_pylist()

    def fold(self, slice_key: str, report: list[dict]) -> list[dict]:
        uris = self.uris(slice_key)
        patches = [f"{uris['entity_patches']}/{r['path']}" for r in report if r["table"] == "entity_patches"]
        written = list(fold.fold_task(iter([{"buckets": list(range(core.STATE_BUCKETS))}]), slice_key=slice_key,
                                      uris=uris, storage_options=None, patch_files=patches, state_files=self.state,
                                      write_state=True))
        self.state = carried(self.state, written, "entities", uris["entities"])
        return written

    def rows(self, slice_key: str, table: str) -> list[dict]:
        return [row for f in self.files(slice_key, table) for row in pq.read_table(f).to_pylist()]

    def files(self, slice_key: str, table: str) -> list[str]:
        return [str(f) for f in sorted(Path(self.uris(slice_key)[table]).glob("*.parquet"))]


def carried(state: dict[int, list[TableFile]], report: list[dict], table: str, folder: str) -> dict[int, list[TableFile]]:
    """A state table's files by bucket after a task's `report`: its rewrites in place of the files they replace."""
    replaced = {r["path"] for r in report if r["table"] == fold.REPLACED + table}
    state = {b: [f for f in files if f.uri not in replaced] for b, files in state.items()}
    for r in report:
        if r["table"] == table:
            uri = f"{folder}/{r['path']}"
            bucket = pq.read_table(uri, columns=["bucket"]).column("bucket")[0].as_py()
            state.setdefault(bucket, []).append(TableFile(r["path"], uri, r["size"], r["rows"], {"bucket": bucket}))
    return state


def patch(entity: str, *ops: dict, collection: str = "Contacts", zone: str = "A") -> dict:
    return {"collection": collection, "zone": zone, "entity": entity, "ops": list(ops)}


def add(path: str, value) -> dict:
    return {"op": "add", "path": path, "value": value}


def subscription(zone: str) -> dict:
    return patch(SUBSCRIPTION, add("subjectZone", zone), add("device", "d1"), add("user", "jsmith"),
                 add("actions", ["created", "updated", "deleted"]), collection=notify.SUBSCRIPTIONS, zone="home")


@pytest.fixture
def lake(tmp_path) -> Lake:
    return Lake(tmp_path)


def counters(report: list[dict]) -> dict[str, int]:
    return {r["table"].removeprefix(fold.COUNTER): r["rows"] for r in report if r["table"].startswith(fold.COUNTER)}


def test_a_redelivered_batch_is_left_out_of_the_patches_and_counted(lake):
    report = lake.explode("0000000001", [{"begun": 10, "patches": [patch("e1", add("a", 1))]},
                                         {"begun": 11, "patches": [patch("e2", add("a", 1)), patch("e3", add("a", 1))]}],
                          redelivered=frozenset({("entity-batches", 0, 1)}))
    assert [r["entity"] for r in lake.rows("0000000001", "entity_patches")] == ["e1"]
    assert counters(report) == {"batches": 1, "redelivered": 1}


def test_only_requests_that_asked_for_learning_reach_schema_learning(lake):
    lake.fold("0000000001", lake.explode("0000000001", [
        {"begun": 10, "learning": True, "patches": [patch("e1", add("name", "Sally"))]},
        {"begun": 11, "learning": False, "patches": [patch("e2", add("name", "Bill"))]},
    ]))
    learned = lake.rows("0000000001", "schema_learning")
    assert [(r["entity"], r["kind"], json.loads(r["after"])) for r in learned] == [("e1", "entity", {"name": "Sally"})]
    assert sorted(r["entity"] for r in lake.rows("0000000001", "entity_updates")) == ["e1", "e2"]


def test_an_update_names_the_slice_of_its_entity_s_update_before(lake):
    lake.fold("0000000001", lake.explode("0000000001", [{"begun": 10, "patches": [patch("e1", add("a", 1))]}]))
    lake.fold("0000000002", lake.explode("0000000002", [{"begun": 20, "patches": [patch("e1", add("b", 2))]},
                                                        {"begun": 21, "patches": [patch("e1", add("c", 3))]},
                                                        {"begun": 22, "patches": [patch("e2", add("a", 1))]}]))
    assert [r["previousSlice"] for r in lake.rows("0000000001", "entity_updates")] == [None]
    second = sorted(lake.rows("0000000002", "entity_updates"), key=lambda r: r["begun"])
    assert [(r["entity"], r["action"], r["previousSlice"]) for r in second] == [
        ("e1", "updated", "0000000001"), ("e1", "updated", "0000000001"), ("e2", "created", None)]


def test_a_subscription_moved_to_another_zone_is_a_zone_change_in_both_zones(lake):
    lake.fold("0000000001", lake.explode("0000000001", [{"begun": 10, "patches": [subscription("A")]}]))
    lake.fold("0000000002", lake.explode("0000000002", [
        {"begun": 20, "patches": [patch(SUBSCRIPTION, {"op": "replace", "path": "subjectZone", "value": "B"},
                                        collection=notify.SUBSCRIPTIONS, zone="home")]}]))
    (created,) = lake.rows("0000000001", "entity_updates")
    (moved,) = lake.rows("0000000002", "entity_updates")
    assert (created["subjectZone"], created["leftZone"]) == ("A", None)
    assert (moved["subjectZone"], moved["leftZone"]) == ("B", "A")

    uris = lake.uris("0000000002")
    report = list(fold.over_files(iter([{"files": lake.files("0000000002", "entity_updates")}]),
                                  body=fold.zone_changes_task, slice_key="0000000002", uris=uris, storage_options=None))
    changes = lake.rows("0000000002", "zone_changes")
    assert [(r["subjectZone"], json.loads(r["after"])["subjectZone"]) for r in changes] == [("B", "B"), ("A", "B")]
    assert counters(report) == {"subjectZone:B": 1, "subjectZone:A": 1}


def test_a_zone_changes_task_counts_its_busiest_zones_and_how_many_others(lake, monkeypatch):
    """A zone per user would send the driver every task's every zone (a million, 1 GB)."""
    monkeypatch.setattr(fold, "ZONES_COUNTED", 2)
    lake.fold("0000000001", lake.explode("0000000001", [
        {"begun": 10, "patches": [patch(f"e{i}", add("n", i), zone=zone) for i, zone in enumerate("AABBBC")]}]))
    report = list(fold.over_files(iter([{"files": lake.files("0000000001", "entity_updates")}]),
                                  body=fold.zone_changes_task, slice_key="0000000001",
                                  uris=lake.uris("0000000001"), storage_options=None))
    assert counters(report) == {"subjectZone:B": 3, "subjectZone:A": 2, fold.ZONES_UNCOUNTED: 1}
    assert len(lake.rows("0000000001", "zone_changes")) == 6  # every row written all the same


def test_a_device_s_new_app_version_moves_it_from_its_old_version_s_count(lake, tmp_path):
    def connections(slice_key: str, *versions: tuple[str, str, int]) -> list[dict]:
        path = tmp_path / f"connections-{slice_key}.parquet"
        rows = [{"slice": slice_key, "kafka_topic": "connections", "kafka_partition": 0, "kafka_offset": i,
                 "kafka_timestamp": begun, "clientid": "c1", "dbid": DB, "user": "jsmith", "device": device,
                 "appVersion": version, "begun": begun} for i, (device, version, begun) in enumerate(versions)]
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMAS["connections"]), path)
        nonlocal state
        out = lake.uris(slice_key)["devices"]
        report = list(fold.over_buckets(iter([{"buckets": list(range(core.STATE_BUCKETS))}]), body=fold.devices_task,
                                        sources={"connections": [str(path)]}, reader=fold.connection_rows,
                                        key_columns=notify.DEVICE_KEY, order=(*notify.DEVICE_KEY, "begun"),
                                        storage_options=None, slice_key=slice_key, uris={"devices": out},
                                        state_files=state, write_state=True))
        state = carried(state, report, "devices", out)
        return report

    state: dict[int, list[TableFile]] = {}
    first = connections("0000000001", ("d1", "1.0", 100), ("d2", "1.0", 101), ("d1", "1.1", 102))
    assert {k: v for k, v in counters(first).items() if k.startswith(fold.APP_VERSION)} == \
        {"app_version:1.1": 1, "app_version:1.0": 1}  # d1's first version is never counted: it left in the slice
    second = connections("0000000002", ("d2", "2.0", 200), ("d1", "1.1", 201))
    assert {k: v for k, v in counters(second).items() if k.startswith(fold.APP_VERSION)} == \
        {"app_version:1.0": -1, "app_version:2.0": 1}  # d1 stays on 1.1: no change counted
