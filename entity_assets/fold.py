"""Spark task bodies of the entity core (mapInArrow functions; no Dagster imported).

Each yields Arrow batches of `FILES_SCHEMA`: the data files it wrote. The entity state is
hash-bucketed (core.STATE_BUCKETS); a task owns whole buckets, reads their state files, folds
the slice's patches in order and writes the bucket back: a MERGE done as copy-on-write of the
touched buckets, committed by the driver in one Delta transaction.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from entity_assets import core
from entity_assets.storage import FileWriter
from entity_assets.tables import SCHEMAS

FILES_SCHEMA = pa.schema([("table", pa.string()), ("path", pa.string()), ("size", pa.int64()),
                          ("rows", pa.int64()), ("stats", pa.string())])
FILES_DDL = "table string, path string, size long, rows long, stats string"
"""The same schema for Spark's mapInArrow."""


COUNT_BATCHES = "count:batches"
"""A pseudo-table in the task report: how many batches a task exploded."""


def _files_batch(files) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([f.to_dict() for f in files], schema=FILES_SCHEMA)


def _rows(batches: Iterator[pa.RecordBatch]) -> Iterator[dict]:
    for batch in batches:
        yield from batch.to_pylist()


def explode_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uri: str, storage_options) -> Iterator[pa.RecordBatch]:
    writer = FileWriter("entity_patches", uri, SCHEMAS["entity_patches"], slice_key, storage_options=storage_options)
    n = 0
    for row in _rows(batches):
        n += 1
        for patch in core.explode_batch(row):
            writer.append(patch)
    yield _files_batch(writer.close())
    yield pa.RecordBatch.from_pylist([{"table": COUNT_BATCHES, "path": "", "size": 0, "rows": n, "stats": ""}],
                                     schema=FILES_SCHEMA)


def _load_bucket(uris: list[str]) -> dict[tuple, core.EntityState]:
    state = {}
    for uri in uris:
        t = pq.read_table(uri, columns=["dbid", "collection", "zone", "entity", "version", "deleted", "document", "ended"])
        for r in t.to_pylist():
            state[(r["dbid"], r["collection"], r["zone"], r["entity"])] = (r["document"], r["version"], r["deleted"], r["ended"])
    return state


def fold_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options,
              state_files: dict[int, list[str]], write_state: bool) -> Iterator[pa.RecordBatch]:
    """Input: the slice's patches of some buckets, sorted by (bucket, entity key, core.ORDER)."""
    updates = FileWriter("entity_updates", uris["entity_updates"], SCHEMAS["entity_updates"], slice_key,
                         storage_options=storage_options)
    partials = FileWriter("partial_responses", uris["partial_responses"], SCHEMAS["partial_responses"], slice_key,
                          storage_options=storage_options)
    states = FileWriter("entities", uris["entities"], SCHEMAS["entities"], slice_key,
                        stats_columns=("slice", "bucket"), storage_options=storage_options)

    bucket, stored, touched = None, {}, {}

    def close_bucket():
        if bucket is None or not write_state or not any(s.changed for s in touched.values()):
            return
        for key, raw in stored.items():
            if key not in touched:
                states.append({"slice": slice_key, "dbid": key[0], "collection": key[1], "zone": key[2], "entity": key[3],
                               "version": raw[1], "deleted": raw[2], "document": raw[0], "ended": raw[3],
                               "bucket": bucket})
        for key, st in touched.items():
            states.append(core.state_row(key, st, slice_key, bucket))
        states.flush()  # one bucket per state file, so the driver can replace buckets file by file

    for patch in _rows(batches):
        if patch["bucket"] != bucket:
            close_bucket()
            bucket, touched = patch["bucket"], {}
            stored = _load_bucket(state_files.get(bucket, []))
        key = (patch["dbid"], patch["collection"], patch["zone"], patch["entity"])
        st = touched.get(key)
        if st is None:
            raw = stored.get(key)
            st = touched[key] = core.EntityState(*raw) if raw else core.EntityState(None, 0, True, None)
        result = core.apply_one(st, patch)
        result["stream"] = "entity-updates"
        partials.append(result)
        if result["status"] == core.STATUS_OK:
            updates.append(result)
    close_bucket()
    yield _files_batch(updates.close() + partials.close() + states.close())


def complete_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str],
                  storage_options, write_state: bool) -> Iterator[pa.RecordBatch]:
    """Input: this slice's partial responses plus pending parts, sorted by (clientid, request, part)."""
    complete = FileWriter("complete_responses", uris["complete_responses"], SCHEMAS["complete_responses"], slice_key,
                          storage_options=storage_options)
    pending = FileWriter("pending_responses", uris["pending_responses"], SCHEMAS["pending_responses"], slice_key,
                         storage_options=storage_options)
    for kind, row in core.split_complete(core.group_requests(_rows(batches)), slice_key):
        if kind == "complete":
            complete.append(row)
        elif write_state:
            pending.append(row)
    yield _files_batch(complete.close() + pending.close())
