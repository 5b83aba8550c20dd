"""Task-side files: row groups per bucket, reading one bucket back, footer bounds, bucket
rewrites by shard and redeliveries, whole or split among tasks (no Spark)."""

import json

import pyarrow as pa
import pytest
import pyarrow.parquet as pq

from entity_assets import shards
from entity_assets.assets.common import file_tasks
from entity_assets.fold import PREFETCH_BYTES, BucketStore, prefetch_depth
from entity_assets.storage import (
    CHECKPOINT_INTERVAL,
    CHECKPOINT_SETTING,
    DeltaRsEngine,
    FileWriter,
    REQUESTS_IN_FLIGHT,
    LayoutError,
    TableFile,
    filesystem,
    key_string,
    key_strings,
    prefetched,
    read_row_groups,
    read_table,
    repeated_deliveries,
)
from entity_assets.tables import SCHEMAS
from resources import LakeResource

KEY = "0000000001"


def patch_row(i: int) -> dict:
    return {"slice": KEY, "entity": f"e{i}", "request": i, "part": 1, "parts": 1, "bucket": (i * 7) % 5}


def test_patches_get_one_row_group_per_bucket_and_a_bucket_reads_back_alone(tmp_path):
    writer = FileWriter("entity_patches", str(tmp_path), SCHEMAS["entity_patches"], KEY,
                        stats_columns=("slice", "bucket"), row_groups_by="bucket")
    for i in range(100):
        writer.append(patch_row(i))
    writer.flush()
    for i in range(100, 130):
        writer.append(patch_row(i))
    files = writer.close()
    uris = [str(tmp_path / f.path) for f in files]
    assert [pq.ParquetFile(u).num_row_groups for u in uris] == [5, 5]
    assert json.loads(files[0].stats)["minValues"]["bucket"] == 0

    rows = read_row_groups(uris, "bucket", 3).to_pylist()
    assert sorted(r["entity"] for r in rows) == sorted(f"e{i}" for i in range(130) if (i * 7) % 5 == 3)
    assert read_row_groups(uris, "bucket", 9).num_rows == 0


def test_a_row_group_whose_statistics_have_no_bounds_is_read(tmp_path):
    """A value past the writer's statistics size leaves a row group without min and max: it may
    hold the value asked for (a file of an older layout mixed collections in a group)."""
    path = str(tmp_path / "mixed.parquet")
    pq.write_table(pa.table({"collection": ["$zoneSubscription", "x" * 5000]}), path)
    assert not pq.ParquetFile(path).metadata.row_group(0).column(0).statistics.has_min_max
    assert read_row_groups([path], "collection", "$zoneSubscription").to_pylist() == [{"collection": "$zoneSubscription"}]


def test_arrow_rows_are_buffered_into_bounded_files_like_dict_rows(tmp_path):
    writer = FileWriter("entity_patches", str(tmp_path), SCHEMAS["entity_patches"], KEY, max_rows=50)
    arrow = pa.Table.from_pylist([patch_row(i) for i in range(30)], SCHEMAS["entity_patches"])
    with pytest.raises(KeyError):  # a column missing is an error, not nulls
        writer.append_table(arrow.drop_columns(["zone"]))
    for _ in range(3):  # 90 rows: one file at the bound, the rest at close
        writer.append_table(arrow)
    writer.append(patch_row(99))
    files = writer.close()
    assert [f.rows for f in files] == [60, 31]
    rows = [r for f in files for r in read_table(str(tmp_path / f.path)).to_pylist()]
    assert [r["entity"] for r in rows[-2:]] == ["e29", "e99"]  # Arrow rows, then the dicts


def test_dead_letters_of_large_records_are_written_in_files_bounded_by_their_bytes(tmp_path):
    """A record's bytes stay in its dead letter: 2,200 of 1 MB in one buffer would pass the 2 GiB an
    Arrow column of binary holds, and the task would fail at every run of its slice."""
    from entity_assets import messages as m
    from entity_assets.ingest import dead_letter

    writer = FileWriter("dead_letters", str(tmp_path), SCHEMAS["dead_letters"], KEY, max_bytes=3_000_000)
    bad = m.InvalidMessage(m.DeadLetterCode.OVERSIZE, "over the limit")
    for offset in range(7):
        dead_letter(writer, bad, KEY, "entity-batches", "entity-batches", 0, offset, 1, b"k", b"x" * 1_000_000)
    files = writer.close()
    assert [f.rows for f in files] == [3, 3, 1]
    rows = [r for f in files for r in read_table(str(tmp_path / f.path)).to_pylist()]
    assert [r["kafka_offset"] for r in rows] == list(range(7)) and {len(r["value"]) for r in rows} == {1_000_000}


def test_arrow_rows_are_written_in_files_bounded_by_their_bytes(tmp_path):
    """A slice of responses that each carry a 1 MB `after` was buffered whole until the task
    ended: 600 of them took a worker 1.5 GB, 10,000 would fail its slice at every run."""
    writer = FileWriter("entity_updates", str(tmp_path), SCHEMAS["entity_updates"], KEY, max_bytes=3_000_000)
    for request in range(7):
        writer.append_table(pa.Table.from_pylist([{"slice": KEY, "entity": "e", "request": request,
                                                   "after": "x" * 1_000_000}], SCHEMAS["entity_updates"]))
    files = writer.close()
    assert [f.rows for f in files] == [3, 3, 1]
    rows = [r for f in files for r in read_table(str(tmp_path / f.path)).to_pylist()]
    assert [r["request"] for r in rows] == list(range(7))


def test_a_file_bound_never_splits_a_key_s_rows_when_the_writer_keeps_keys_whole(tmp_path):
    """entity_updates files keep an entity's updates together: zone_changes' tasks split the files
    and publish each entity's zone changes in file order."""
    writer = FileWriter("entity_updates", str(tmp_path), SCHEMAS["entity_updates"], KEY, max_rows=5,
                        whole_keys="entity")

    def rows(*entities):
        return pa.Table.from_pylist([{"slice": KEY, "entity": e, "request": i} for i, e in enumerate(entities)],
                                    SCHEMAS["entity_updates"])

    writer.append_table(rows("a", "a", "b", "b", "b"))  # at the bound: b may go on, so it stays
    writer.append_table(rows("b", "c", "c"))
    writer.append_table(rows(*"dddddd"))  # c is cut before d, which stays, past the bound: a key is never split
    writer.append_table(rows("d"))
    writer.append_table(rows("e"))
    files = writer.close()
    written = [[r["entity"] for r in read_table(str(tmp_path / f.path)).to_pylist()] for f in files]
    assert written == [["a", "a"], ["b", "b", "b", "b"], ["c", "c"], ["d"] * 7, ["e"]]
    assert all(not set(x) & set(y) for i, x in enumerate(written) for y in written[i + 1:])
    # nor by the byte bound: seven updates of one entity with a 1 MB `after` each
    writer = FileWriter("entity_updates", str(tmp_path), SCHEMAS["entity_updates"], KEY, max_bytes=3_000_000,
                        whole_keys="entity")
    for request, entity in enumerate("aeeeeeb"):
        writer.append_table(pa.Table.from_pylist([{"slice": KEY, "entity": entity, "request": request,
                                                   "after": "x" * 1_000_000}], SCHEMAS["entity_updates"]))
    written = [[r["entity"] for r in read_table(str(tmp_path / f.path)).to_pylist()] for f in writer.close()]
    assert written == [["a"], ["e"] * 5, ["b"]]


def test_footer_bounds_cover_every_row_group_of_the_slice(tmp_path):
    engine = DeltaRsEngine(str(tmp_path))
    engine.ensure("entity_updates", SCHEMAS["entity_updates"])
    writer = FileWriter("entity_updates", engine.uri("entity_updates"), SCHEMAS["entity_updates"], KEY)
    for status in (1, 1, 3):
        writer.append({"slice": KEY, "status": status})
    (written,) = writer.close()
    engine.commit("entity_updates", SCHEMAS["entity_updates"], add=[written], operation="test", slice_key=KEY)
    assert engine.column_bounds("entity_updates", KEY, "status") == (1, 3)
    assert engine.column_bounds("entity_updates", "0000000002", "status") is None


@pytest.mark.parametrize("root", ["my lake", "hash#lake", "é lake"])
def test_a_lake_whose_path_holds_characters_a_uri_escapes_reads_back(tmp_path, root):
    """delta-rs gives a table's URI percent-encoded (`my%20lake`): its files are read at the path."""
    engine = DeltaRsEngine(str(tmp_path / root))
    engine.ensure("entity_updates", SCHEMAS["entity_updates"])
    writer = FileWriter("entity_updates", engine.uri("entity_updates"), SCHEMAS["entity_updates"], KEY)
    writer.append({"slice": KEY, "status": 1})
    engine.replace_slice("entity_updates", SCHEMAS["entity_updates"], writer.close(), KEY)
    assert engine.read("entity_updates").column("status").to_pylist() == [1]
    assert engine.missing("entity_updates", engine.files("entity_updates")) == []
    # the same lake named as a URI: its `#` is a folder's name, not a fragment
    assert filesystem(f"file://{tmp_path / root}/entity_updates/x?y#z", None)[1] == \
        f"{tmp_path / root}/entity_updates/x?y#z"
    assert filesystem("s3://bucket/hash#lake/t?v", {"endpoint_url": "http://127.0.0.1:1"})[1] == "bucket/hash#lake/t?v"


def test_an_engine_keeps_its_table_handles_current_with_other_writers_commits(tmp_path):
    reader, writer_engine = DeltaRsEngine(str(tmp_path)), DeltaRsEngine(str(tmp_path))
    reader.ensure("entity_updates", SCHEMAS["entity_updates"])
    assert reader.version("entity_updates") == 0 and reader.files("entity_updates") == []
    writer = FileWriter("entity_updates", writer_engine.uri("entity_updates"), SCHEMAS["entity_updates"], KEY)
    writer.append({"slice": KEY, "status": 1})
    (written,) = writer.close()
    writer_engine.replace_slice("entity_updates", SCHEMAS["entity_updates"], [written], KEY)
    assert reader.version("entity_updates") == 1  # the kept handle caught up
    assert [f.path for f in reader.files("entity_updates")] == [written.path]
    assert reader.files("entity_updates", version=0) == []  # a past version stays as it was
    assert reader.version_after("entity_updates", KEY, "replace_slice") == 1


def test_slice_files_and_reads_pick_files_by_their_statistics(tmp_path):
    engine, table = DeltaRsEngine(str(tmp_path)), "entity_updates"
    engine.ensure(table, SCHEMAS[table])

    def write(*rows):
        writer = FileWriter(table, engine.uri(table), SCHEMAS[table], KEY)
        for slice_key, status in rows:
            writer.append({"slice": slice_key, "status": status})
        (written,) = writer.close()
        return written

    a, b, both = write(("0000000001", 1)), write(("0000000002", 3)), write(("0000000001", 1), ("0000000002", 1))
    engine.commit(table, SCHEMAS[table], add=[a, b], operation="test", slice_key=KEY)
    assert [f.path for f in engine.slice_files(table, ["0000000001"])] == [a.path]
    assert sorted(f.path for f in engine.slice_files(table, ["0000000001", "0000000002"])) == sorted([a.path, b.path])
    assert engine.slice_files(table, ["0000000003"]) == []
    engine.commit(table, SCHEMAS[table], add=[both], operation="test", slice_key=KEY)
    assert engine.read(table, where={"slice": "0000000002"}).column("status").to_pylist() in ([3, 1], [1, 3])
    assert engine.read(table, where={"status": 3}).column("slice").to_pylist() == ["0000000002"]
    assert len(engine.files(table)) == 3 and engine.files(table)[0].min.keys() >= {"slice"}
    with pytest.raises(LayoutError, match="1 file"):  # never a file of two slices: not this engine's layout
        engine.slice_files(table, ["0000000001"])


def test_a_stream_table_another_engine_compacted_is_refused_not_read_as_slices_without_rows(tmp_path):
    """delta-rs's (or Spark's) OPTIMIZE merges slices' files: a re-run then kept their rows beside
    its own, and a step read no rows of their slices."""
    from deltalake import DeltaTable

    engine, table = DeltaRsEngine(str(tmp_path)), "entity_updates"
    engine.ensure(table, SCHEMAS[table])
    for key in ("0000000001", "0000000002"):
        writer = FileWriter(table, engine.uri(table), SCHEMAS[table], key)
        writer.append({"slice": key, "status": 1})
        engine.replace_slice(table, SCHEMAS[table], writer.close(), key)
    DeltaTable(engine.uri(table)).optimize.compact()
    with pytest.raises(LayoutError, match="several slices"):
        DeltaRsEngine(str(tmp_path)).slice_files(table, ["0000000001"])


def test_the_state_key_check_fails_on_repeated_keys_or_overlapping_shard_files(tmp_path):
    from collections import Counter

    from entity_assets.assets.common import commit_state, one_row_per_key

    engine = DeltaRsEngine(str(tmp_path))

    def state_file(table, shard, **row):
        writer = FileWriter(table, engine.uri(table), SCHEMAS[table], KEY, stats_columns=("slice", "bucket"))
        writer.write_table(SCHEMAS[table].empty_table(), [{"slice": KEY, "bucket": 0, **row}], tag=shard.tag)
        return writer.close()

    def check(table, version, repeated=0, replayed=False):
        return one_row_per_key(engine, table, KEY, Counter({f"check:repeated_keys:{table}": repeated}),
                               {"version": version, "replayed": replayed}, asset_key=table, check_name="one_row_per_key")

    whole, (low, high) = shards.Shard(0, 0), shards.Shard(0, 0).halves()
    engine.ensure("devices", SCHEMAS["devices"])  # a bucket's whole range and its lower half: keys in both
    v = commit_state(engine, "devices", KEY, state_file("devices", whole, device="d1") + state_file("devices", low, device="d2"), [])
    overlapping = check("devices", v)
    assert overlapping.passed is False and overlapping.metadata["files_overlapping_another"].value == 1

    engine.ensure("schemas", SCHEMAS["schemas"])  # the two halves: no overlap
    v = commit_state(engine, "schemas", KEY, state_file("schemas", low, dbid="a") + state_file("schemas", high, dbid="b"), [])
    assert check("schemas", v).passed is True
    assert check("schemas", v, repeated=2).passed is False  # a task counted repeated keys in a file it wrote
    # a replayed slice checks the version its first run made, found in the history
    engine.commit("schemas", SCHEMAS["schemas"], add=state_file("schemas", whole, dbid="c"), remove=[], operation="write",
                  slice_key=KEY)
    assert check("schemas", None, replayed=True).passed is True


def test_version_after_finds_old_commits_beyond_the_first_page_of_history(tmp_path):
    engine = DeltaRsEngine(str(tmp_path))
    engine.ensure("entities", SCHEMAS["entities"])
    for seq in range(1, 41):
        engine.commit("entities", SCHEMAS["entities"], add=[], operation="apply", slice_key=f"{seq:010d}")
    assert engine.version_after("entities", f"{40:010d}", "apply") == 40
    assert engine.version_after("entities", f"{3:010d}", "apply") == 3  # older than the first page
    assert engine.version_after("entities", f"{3:010d}", "replace_slice") is None
    assert engine.version_after("entities", f"{41:010d}", "apply") is None


def test_file_tasks_use_every_core_on_a_large_slice_and_one_task_on_a_small_one():
    def files(*rows):
        return [TableFile(path=f"f{i}", uri=f"/t/f{i}", size=1, rows=n) for i, n in enumerate(rows)]

    assert file_tasks(files(30, 40, 30), max_rows=200_000, parallelism=2) == [{"files": files(30, 40, 30)}]
    big = file_tasks(files(*[50_000] * 4), max_rows=200_000, parallelism=2)
    assert [len(t["files"]) for t in big] == [2, 2]
    capped = file_tasks(files(*[200_000] * 5), max_rows=200_000, parallelism=2)
    assert len(capped) == 5


def test_key_strings_tell_apart_keys_that_a_plain_separator_would_merge():
    keys = [("a:1", "b"), ("a", "1:b"), (None, ""), ("", None), ("", "")]
    table = pa.table({"x": [k[0] for k in keys], "y": [k[1] for k in keys]})
    strings = key_strings(table, ["x", "y"]).to_pylist()
    assert strings == [key_string(k) for k in keys]
    assert len(set(strings)) == len(keys)


def committed(root, f) -> TableFile:
    """A written file as a commit of it lists it (as `DeltaRsEngine.files` gives it)."""
    return TableFile(path=f.path, uri=str(root / f.path), size=f.size, rows=f.rows)


def entity_row(i: int, slice_key: str = KEY, version: int = 1) -> dict:
    return {"slice": slice_key, "dbid": "db", "collection": "C", "zone": "z", "entity": f"e{i}", "version": version,
            "deleted": False, "document": json.dumps({"n": i}), "ended": i, "bucket": 0}


def test_a_bucket_rewrite_reads_only_the_wanted_keys_and_keeps_every_other_row(tmp_path):
    key = ("dbid", "collection", "zone", "entity")
    first = FileWriter("entities", str(tmp_path), SCHEMAS["entities"], KEY, stats_columns=("slice", "bucket"))
    for i in range(1000):
        first.append(entity_row(i))
    (stored,) = first.close()

    second = FileWriter("entities", str(tmp_path), SCHEMAS["entities"], "0000000002", stats_columns=("slice", "bucket"))
    store = BucketStore(second, key, {0: [committed(tmp_path, stored)]}, enabled=True)
    wanted = [("db", "C", "z", "e5"), ("db", "C", "z", "new")]
    store.switch(0, pa.array([key_string(k) for k in wanted]))
    assert set(store.stored) == {("db", "C", "z", "e5")}  # only the slice's keys became dicts
    assert store.get(("db", "C", "z", "e5"))["version"] == 1
    store.put(("db", "C", "z", "e5"), entity_row(5, "0000000002", version=2))
    store.put(("db", "C", "z", "new"), {**entity_row(0, "0000000002"), "entity": "new"})
    store.close()

    (rewritten,) = second.close()
    rows = read_table(str(tmp_path / rewritten.path)).to_pylist()
    by_entity = {r["entity"]: r for r in rows}
    assert len(rows) == len(by_entity) == 1001 and store.repeated_keys == 0
    assert by_entity["e5"]["version"] == 2 and by_entity["e6"]["version"] == 1 and "new" in by_entity
    assert store.replaced == [committed(tmp_path, stored)] and shards.of_file(rewritten.path) == shards.WHOLE


def test_a_bucket_outgrowing_its_file_bound_splits_and_a_later_change_rewrites_one_file(tmp_path):
    key = ("dbid", "collection", "zone", "entity")

    def fold(slice_key, state_files, changes):
        writer = FileWriter("entities", str(tmp_path), SCHEMAS["entities"], slice_key, stats_columns=("slice", "bucket"))
        store = BucketStore(writer, key, state_files, enabled=True, file_rows=300)
        store.switch(0, pa.array([key_string(("db", "C", "z", r["entity"])) for r in changes]))
        for r in changes:
            store.put(("db", "C", "z", r["entity"]), r)
        store.close()
        return writer.close(), store

    first, store = fold(KEY, {}, [entity_row(i) for i in range(1000)])
    assert store.replaced == [] and all(f.rows <= 300 for f in first) and sum(f.rows for f in first) == 1000
    assert len(first) >= 4 and shards.overlapping(shards.of_file(f.path) for f in first) == 0

    stored = [committed(tmp_path, f) for f in first]
    second, store = fold("0000000002", {0: stored}, [entity_row(7, "0000000002", version=2)])
    # only the file holding e7 is read and rewritten
    (replaced,) = store.replaced
    (rewritten,) = second
    assert rewritten.rows == replaced.rows and shards.of_file(rewritten.path) == shards.of_file(replaced.path)
    live = [str(tmp_path / rewritten.path)] + [f.uri for f in stored if f != replaced]
    rows = pa.concat_tables([read_table(u) for u in live]).to_pylist()
    assert len(rows) == len({r["entity"] for r in rows}) == 1000
    assert [r["version"] for r in rows if r["entity"] == "e7"] == [2]


def test_a_shard_of_large_documents_splits_by_its_bytes_too(tmp_path, monkeypatch):
    """20,000 documents of 110 KB, under the row bound, would pass the 2 GiB an Arrow column of
    text holds: a state file also holds about `shards.FILE_BYTES` at most."""
    key = ("dbid", "collection", "zone", "entity")
    monkeypatch.setattr(shards, "FILE_BYTES", 50_000)
    writer = FileWriter("entities", str(tmp_path), SCHEMAS["entities"], KEY, stats_columns=("slice", "bucket"))
    store = BucketStore(writer, key, {}, enabled=True)
    rows = [{**entity_row(i), "document": json.dumps({"text": "x" * 1000, "n": i})} for i in range(200)]
    store.switch(0, pa.array([key_string(("db", "C", "z", r["entity"])) for r in rows]))
    for r in rows:
        store.put(("db", "C", "z", r["entity"]), r)
    store.close()
    files = writer.close()
    assert len(files) >= 4 and sum(f.rows for f in files) == 200 and max(f.rows for f in files) < 100
    assert shards.overlapping(shards.of_file(f.path) for f in files) == 0


def test_state_files_keep_a_row_group_per_collection_so_one_collection_reads_alone(tmp_path):
    writer = FileWriter("entities", str(tmp_path), SCHEMAS["entities"], KEY, stats_columns=("slice", "bucket"),
                        row_groups_by="collection")
    store = BucketStore(writer, ("dbid", "collection", "zone", "entity"), {}, enabled=True)
    store.switch(0, pa.array([], pa.string()))
    for i in range(30):
        row = {**entity_row(i), "collection": ["Contacts", "$zoneSubscription", "Groups"][i % 3]}
        store.put(("db", row["collection"], "z", row["entity"]), row)
    store.close()
    (written,) = writer.close()
    meta = pq.ParquetFile(tmp_path / written.path).metadata
    column = meta.schema.to_arrow_schema().get_field_index("collection")
    bounds = [(meta.row_group(g).column(column).statistics.min, meta.row_group(g).column(column).statistics.max)
              for g in range(meta.num_row_groups)]
    assert bounds == [("$zoneSubscription", "$zoneSubscription"), ("Contacts", "Contacts"), ("Groups", "Groups")]


def test_a_bucket_left_untouched_is_not_rewritten(tmp_path):
    writer = FileWriter("entities", str(tmp_path), SCHEMAS["entities"], KEY, stats_columns=("slice", "bucket"))
    writer.append(entity_row(1))
    (stored,) = writer.close()
    rewrite = FileWriter("entities", str(tmp_path), SCHEMAS["entities"], "0000000002")
    store = BucketStore(rewrite, ("entity",), {0: [committed(tmp_path, stored)]}, enabled=True)
    store.switch(0)
    assert store.get(("e1",))["document"] == '{"n": 1}'
    store.close()
    assert rewrite.close() == []


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_redeliveries_within_the_slice_and_from_the_window_whatever_the_split(tmp_path, parts):
    schema = pa.schema([("clientid", pa.string()), ("request", pa.int64()), ("kafka_topic", pa.string()),
                        ("kafka_partition", pa.int32()), ("kafka_offset", pa.int64()), ("begun", pa.int64())])

    def write(name, rows):
        pq.write_table(pa.Table.from_pylist(rows, schema), tmp_path / name)
        return str(tmp_path / name)

    def delivery(client, request, partition, offset, begun=100):
        return {"clientid": client, "request": request, "kafka_topic": "t", "kafka_partition": partition,
                "kafka_offset": offset, "begun": begun}

    prior = write("prior.parquet", [delivery("c1", 1, 0, 0), delivery("c2", 7, 1, 0), delivery("c3", 3, 1, 1),
                                    delivery("c5", 1, 1, 2, begun=50),
                                    delivery("c7", 2, 1, 3, begun=10), delivery("c7", 2, 1, 4, begun=20)])
    this = write("slice.parquet", [
        delivery("c1", 2, 0, 5), delivery("c1", 2, 1, 3),  # the same request twice: the later copy is repeated
        delivery("c2", 7, 0, 6),                           # seen in the window
        delivery("c1", 7, 0, 7),                           # another client's request id: new
        delivery("c4", -5, 2, 9), delivery("c4", -5, 2, 1), delivery("c4", -5, 3, 0),  # three times: two repeats
        delivery("c3", 3, 3, 4), delivery("c3", 3, 0, 8),  # in the window and twice here: both repeats
        # an id used again for another request (another `begun`): repeats, marked reused; a
        # redelivery of that one after it is not reused
        delivery("c5", 1, 0, 9), delivery("c6", 4, 0, 10, begun=1), delivery("c6", 4, 0, 11, begun=2),
        delivery("c6", 4, 0, 12, begun=2),
        delivery("c7", 2, 0, 13, begun=10),  # the window used the id twice: either stamp is a redelivery's
    ])
    found = []
    for part in range(parts):  # the tasks' shares add up to the whole, each repeat found once
        found += repeated_deliveries([this], [prior], ("clientid", "request"),
                                     ("kafka_topic", "kafka_partition", "kafka_offset"),
                                     split_by="request", part=part, parts=parts)
    assert len({r.at for r in found}) == len(found)
    assert {(r.at, r.reused) for r in found} == {
        (("t", 1, 3), False), (("t", 0, 6), False), (("t", 2, 9), False), (("t", 3, 0), False),
        (("t", 3, 4), False), (("t", 0, 8), False), (("t", 0, 9), True), (("t", 0, 11), True),
        (("t", 0, 12), False), (("t", 0, 13), False)}
    assert {r.identity for r in found if r.reused} == {("c5", 1), ("c6", 4)}


def test_a_table_of_an_older_layout_is_refused_with_how_to_rebuild_it(tmp_path):
    engine = DeltaRsEngine(str(tmp_path))
    old = pa.schema([f for f in SCHEMAS["devices"] if f.name != "bucket"])
    engine.ensure("devices", old)
    with pytest.raises(LayoutError, match=r"table devices .* lacks bucket\)\. Rebuild it"):
        engine.commit("devices", SCHEMAS["devices"], add=[], operation="apply", slice_key=KEY)
    with pytest.raises(LayoutError, match=r"lacks bucket"):  # nor read as state by a fold
        engine.files("devices", layout=SCHEMAS["devices"])
    assert engine.version("devices") == 0  # nothing committed
    engine.ensure("entities", SCHEMAS["entities"])
    engine.commit("entities", SCHEMAS["entities"], add=[], operation="apply", slice_key=KEY)  # the current layout


def test_tables_checkpoint_every_ten_commits_and_an_older_table_is_given_the_interval_once(tmp_path):
    from deltalake import DeltaTable

    engine, table = DeltaRsEngine(str(tmp_path)), "entity_updates"
    DeltaTable.create(engine.uri(table), SCHEMAS[table])  # as a lake made before the setting
    engine.ensure(table, SCHEMAS[table])
    engine.ensure(table, SCHEMAS[table])  # given once: one commit
    assert engine.version(table) == 1
    for i in range(CHECKPOINT_INTERVAL):
        writer = FileWriter(table, engine.uri(table), SCHEMAS[table], f"{i:010d}")
        writer.append({"slice": f"{i:010d}", "status": 1})
        engine.replace_slice(table, SCHEMAS[table], writer.close(), f"{i:010d}")
    assert list((tmp_path / table / "_delta_log").glob("*.checkpoint.parquet"))
    fresh = DeltaRsEngine(str(tmp_path / "other"))
    fresh.ensure(table, SCHEMAS[table])
    assert DeltaTable(fresh.uri(table)).metadata().configuration == {CHECKPOINT_SETTING: str(CHECKPOINT_INTERVAL)}
    assert fresh.version(table) == 0


def test_a_step_engine_reads_each_table_as_of_its_first_look_and_its_own_commits(tmp_path):
    step, other = DeltaRsEngine(str(tmp_path), snapshot=True), DeltaRsEngine(str(tmp_path))
    step.ensure("entities", SCHEMAS["entities"])
    start = step.version("entities")
    other.commit("entities", SCHEMAS["entities"], add=[], operation="apply", slice_key=KEY)
    assert step.version("entities") == start  # no request for others' commits at each look
    assert other.version("entities") == start + 1  # an engine without snapshot follows them
    # its own commit lands after the others' (delta-rs finds the newer version) and brings it up to date
    assert step.commit("entities", SCHEMAS["entities"], add=[], operation="apply", slice_key="0000000002") == start + 2
    assert step.version_after("entities", KEY, "apply") == start + 1


def test_the_version_the_latest_handle_is_at_is_read_without_opening_the_log_again(tmp_path, monkeypatch):
    import deltalake

    engine = DeltaRsEngine(str(tmp_path), snapshot=True)
    engine.ensure("entity_updates", SCHEMAS["entity_updates"])
    writer = FileWriter("entity_updates", engine.uri("entity_updates"), SCHEMAS["entity_updates"], KEY)
    writer.append({"slice": KEY, "status": 1})
    version = engine.replace_slice("entity_updates", SCHEMAS["entity_updates"], writer.close(), KEY)
    opened, open_table = [], deltalake.DeltaTable.__init__

    def counting(self, *args, **kwargs):
        opened.append(kwargs.get("version"))
        open_table(self, *args, **kwargs)

    monkeypatch.setattr(deltalake.DeltaTable, "__init__", counting)
    assert engine.files("entity_updates", version) == engine.files("entity_updates") != []  # as a state check reads it
    assert engine.files("entity_updates", version - 1) == []
    assert opened == [version - 1]  # only the older version is opened
    # a manifest-like append goes through the table's handle, which it leaves at the new version
    appended = engine.append_small("entity_updates", pa.Table.from_pylist([{"slice": "0000000002", "status": 1}],
                                                                          SCHEMAS["entity_updates"]), slice_key="0000000002")
    assert appended == version + 1 == engine.version("entity_updates") and opened == [version - 1]
    assert len(engine.files("entity_updates")) == 2


def test_a_failed_call_is_raised_after_the_calls_running_beside_it_end():
    """Sibling commits still in their store's backoff ended after the error reached the step,
    whose retry then took a snapshot without them and committed the slice's rows again."""
    import threading
    import time

    started, ended, one_started = [], [], threading.Event()

    def commit(i):
        if i == 0:
            one_started.wait(30)  # a sibling is in its commit when this one fails
            raise OSError("the store refused")
        started.append(i)
        one_started.set()
        time.sleep(0.3)
        ended.append(i)

    with pytest.raises(OSError, match="refused"):
        list(prefetched(commit, range(4), 4))
    assert started and sorted(ended) == sorted(started)  # those not started are dropped, the others waited for


def test_prefetched_calls_run_ahead_in_threads_and_come_back_in_order():
    import threading
    import time

    threads = set()

    def slow(i):
        threads.add(threading.get_ident())
        time.sleep(0.01 * (5 - i % 5))  # later items end first
        return i * i

    assert list(prefetched(slow, range(20), 4)) == [i * i for i in range(20)]
    assert threading.get_ident() not in threads
    threads.clear()
    assert list(prefetched(slow, range(5), 0)) == [i * i for i in range(5)] and threads == {threading.get_ident()}

    def failing(i):
        if i == 3:
            raise ValueError("item 3")
        return i

    # asked for from a reading thread, reads run in that thread: queued behind it, they would wait forever
    def nested(i):
        return [j * i for j in prefetched(slow, range(3), 4)]

    done = []
    outer = threading.Thread(target=lambda: done.append(list(prefetched(nested, range(3 * REQUESTS_IN_FLIGHT), 64))))
    outer.start()
    outer.join(timeout=60)
    assert done == [[[j * j * i for j in range(3)] for i in range(3 * REQUESTS_IN_FLIGHT)]]

    results = prefetched(failing, range(10), 4)
    assert [next(results) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="item 3"):
        next(results)


def test_a_forked_child_reads_ahead_with_threads_of_its_own():
    import os
    import signal
    import time

    def later(i):
        time.sleep(0.01)
        return i + 1

    assert list(prefetched(later, range(32), 32)) == list(range(1, 33))  # every thread of the parent's pool started
    pid = os.fork()
    if pid == 0:  # the parent's threads are not in the child: waiting on them would never end
        signal.alarm(30)
        os._exit(0 if list(prefetched(lambda i: i + 1, range(4), 2)) == [1, 2, 3, 4] else 1)
    assert os.waitpid(pid, 0)[1] == 0


def test_fold_tasks_read_ahead_only_on_an_object_store_and_within_a_byte_budget():
    def files(*sizes):
        return {b: [TableFile(f"p{b}-{i}", f"s3://b/p{b}-{i}", size, 1) for i, size in enumerate(bucket)]
                for b, bucket in enumerate(sizes)}

    assert prefetch_depth("/lake/entities", files([100])) == 0
    assert prefetch_depth("file:///lake/entities", files([100])) == 0
    assert prefetch_depth("s3://b/lake/entities", {}) == REQUESTS_IN_FLIGHT  # no state yet
    assert prefetch_depth("s3://b/lake/entities", files([100], [200, 300])) == REQUESTS_IN_FLIGHT
    assert prefetch_depth("abfss://c@a.dfs.core.windows.net/lake/entities",
                          files([PREFETCH_BYTES // 3], [PREFETCH_BYTES // 8])) == 3
    assert prefetch_depth("s3://b/lake/entities", files([PREFETCH_BYTES * 2])) == 1


def test_a_bucket_fetched_in_another_thread_switches_in_as_a_read_in_line_would(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    key = ("dbid", "collection", "zone", "entity")
    first = FileWriter("entities", str(tmp_path), SCHEMAS["entities"], KEY, stats_columns=("slice", "bucket"))
    for i in range(100):
        first.append(entity_row(i))
    state = {0: [committed(tmp_path, f) for f in first.close()]}
    wanted = pa.array([key_string(("db", "C", "z", f"e{i}")) for i in (3, 50)])

    def rewrite(fetch: bool) -> list[dict]:
        writer = FileWriter("entities", str(tmp_path), SCHEMAS["entities"], "0000000002", stats_columns=("slice", "bucket"))
        store = BucketStore(writer, key, state, enabled=True)
        if fetch:
            with ThreadPoolExecutor(1) as pool:
                store.switch(0, fetched=pool.submit(store.fetch, 0, wanted).result())
        else:
            store.switch(0, wanted)
        assert set(store.stored) == {("db", "C", "z", "e3"), ("db", "C", "z", "e50")}
        store.put(("db", "C", "z", "e3"), entity_row(3, "0000000002", version=2))
        store.close()
        (written,) = writer.close()
        return sorted(read_table(str(tmp_path / written.path)).drop_columns(["slice"]).to_pylist(), key=str)

    assert rewrite(fetch=True) == rewrite(fetch=False)


def test_the_lake_refuses_an_engine_it_does_not_ship_when_it_is_made(tmp_path):
    """At the code location's load (or the launchpad's config check), not in a run's first step."""
    with pytest.raises(ValueError, match="engine\n.*'delta-rs'"):
        LakeResource(root=str(tmp_path), engine="delta-spark")
