"""Task-side files: row groups per bucket, reading one bucket back, footer bounds (no Spark)."""

import json

import pyarrow.parquet as pq

from entity_assets.assets.common import file_tasks
from entity_assets.storage import DeltaRsEngine, FileWriter, TableFile, read_row_groups
from entity_assets.tables import SCHEMAS

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


def test_file_tasks_use_every_core_on_a_large_slice_and_one_task_on_a_small_one():
    def files(*rows):
        return [TableFile(path=f"f{i}", uri=f"/t/f{i}", size=1, rows=n) for i, n in enumerate(rows)]

    assert file_tasks(files(30, 40, 30), max_rows=200_000, parallelism=2) == [{"uris": ["/t/f0", "/t/f1", "/t/f2"]}]
    big = file_tasks(files(*[50_000] * 4), max_rows=200_000, parallelism=2)
    assert [len(t["uris"]) for t in big] == [2, 2]
    capped = file_tasks(files(*[200_000] * 5), max_rows=200_000, parallelism=2)
    assert len(capped) == 5
