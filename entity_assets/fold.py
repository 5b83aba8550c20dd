"""Spark task bodies (mapInArrow functions; no Dagster imported).

Each yields Arrow batches of `FILES_SCHEMA`: the data files it wrote. State tables (entities,
schemas, device inboxes) are hash-bucketed: a task owns whole buckets, reads their state
files, folds the slice's rows in order and writes each touched bucket back: a MERGE done as
copy-on-write of the touched buckets, committed by the driver in one Delta transaction.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from entity_assets import core, notify
from entity_assets.storage import FileWriter
from entity_assets.tables import SCHEMAS

FILES_SCHEMA = pa.schema([("table", pa.string()), ("path", pa.string()), ("size", pa.int64()),
                          ("rows", pa.int64()), ("stats", pa.string())])
FILES_DDL = "table string, path string, size long, rows long, stats string"
"""The same schema for Spark's mapInArrow."""

COUNT_BATCHES = "count:batches"
"""A pseudo-table in the task report: how many batches a task exploded."""


def _report(writers: Iterable[FileWriter]) -> pa.RecordBatch:
    files = [f for w in writers for f in w.close()]
    return pa.RecordBatch.from_pylist([f.to_dict() for f in files], schema=FILES_SCHEMA)


def _rows(batches: Iterator[pa.RecordBatch]) -> Iterator[dict]:
    for batch in batches:
        yield from batch.to_pylist()


class Writers(dict):
    """One FileWriter per table, created on first use."""

    def __init__(self, slice_key: str, uris: dict[str, str], storage_options):
        super().__init__()
        self.slice_key, self.uris, self.storage_options = slice_key, uris, storage_options

    def __missing__(self, table: str) -> FileWriter:
        stats = ("slice", "bucket") if "bucket" in SCHEMAS[table].names else ("slice",)
        w = self[table] = FileWriter(table, self.uris[table], SCHEMAS[table], self.slice_key,
                                     stats_columns=stats, storage_options=self.storage_options)
        return w


class BucketStore:
    """The rows of one bucketed state table that a task owns, one bucket at a time."""

    def __init__(self, writer: FileWriter, key_columns: tuple[str, ...], state_files: dict[int, list[str]], enabled: bool):
        self.writer, self.key_columns, self.state_files, self.enabled = writer, key_columns, state_files, enabled
        self.bucket, self.stored, self.changed = None, {}, {}

    def switch(self, bucket: int) -> None:
        if bucket != self.bucket:
            self.close()
            self.bucket, self.changed, self.stored = bucket, {}, {}
            for uri in self.state_files.get(bucket, []):
                for row in pq.read_table(uri).to_pylist():
                    self.stored[tuple(row[c] for c in self.key_columns)] = row

    def get(self, key: tuple) -> dict | None:
        return self.changed.get(key) or self.stored.get(key)

    def put(self, key: tuple, row: dict) -> None:
        self.changed[key] = row

    def close(self) -> None:
        """Writes the bucket back (one file per bucket, so the driver replaces buckets file by file)."""
        if self.bucket is None or not self.enabled or not self.changed:
            return
        for key, row in self.stored.items():
            if key not in self.changed:
                self.writer.append(row)
        for row in self.changed.values():
            self.writer.append(row)
        self.writer.flush()


# --------------------------------------------------------------------------- entity core

def explode_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options) -> Iterator[pa.RecordBatch]:
    out = Writers(slice_key, uris, storage_options)
    n = 0
    for row in _rows(batches):
        n += 1
        for patch in core.explode_batch(row):
            out["entity_patches"].append(patch)
    yield _report(out.values())
    yield pa.RecordBatch.from_pylist([{"table": COUNT_BATCHES, "path": "", "size": 0, "rows": n, "stats": ""}],
                                     schema=FILES_SCHEMA)


def fold_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options,
              state_files: dict[int, list[str]], write_state: bool) -> Iterator[pa.RecordBatch]:
    """Input: the slice's patches of some buckets, sorted by (bucket, entity key, core.ORDER)."""
    out = Writers(slice_key, uris, storage_options)
    store = BucketStore(out["entities"], core.ENTITY_KEY, state_files, write_state)
    key, state = None, None
    for patch in _rows(batches):
        store.switch(patch["bucket"])
        k = (patch["dbid"], patch["collection"], patch["zone"], patch["entity"])
        if k != key:
            key, state = k, core.DocState(store.get(k))
        before = state.doc
        result = core.apply_one(state, patch)
        if result["status"] == core.STATUS_OK:
            result["subjectZone"] = notify.subject_zone(k[1], k[2], state.doc if state.doc is not None else before)
            out["entity_updates"].append(result)
            if patch["learning"] and state.doc is not None:
                out["schema_learning"].append(core.learning_row(result, state.doc))
            store.put(k, state.row(dict(zip(core.ENTITY_KEY, k)), slice_key, patch["bucket"]))
        out["partial_responses"].append({**result, "stream": "entity-updates"})
    store.close()
    yield _report(out.values())


def schema_fold_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options,
                     state_files: dict[int, list[str]], write_state: bool) -> Iterator[pa.RecordBatch]:
    """Input: the slice's schema patches, sorted by (bucket, dbid, core.ORDER)."""
    out = Writers(slice_key, uris, storage_options)
    store = BucketStore(out["schemas"], ("dbid",), state_files, write_state)
    dbid, state = None, None
    for patch in _rows(batches):
        store.switch(patch["bucket"])
        if patch["dbid"] != dbid:
            dbid, state = patch["dbid"], core.DocState(store.get((patch["dbid"],)))
        result = core.apply_one(state, patch, implicit_empty=True)
        if result["status"] == core.STATUS_OK:
            out["schema_updates"].append(result)
            for row in core.entity_type_rows(result, state.doc or {}):
                out["schema_learning"].append(row)
            store.put((dbid,), state.row({"dbid": dbid}, slice_key, patch["bucket"]))
        out["partial_responses"].append({**result, "stream": "schema-updates"})
    store.close()
    yield _report(out.values())


def complete_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str],
                  storage_options, write_state: bool) -> Iterator[pa.RecordBatch]:
    """Input: this slice's partial responses plus pending parts, sorted by (clientid, request, stream, part)."""
    out = Writers(slice_key, uris, storage_options)
    for kind, row in core.split_complete(core.group_requests(_rows(batches)), slice_key):
        if kind == "complete":
            out["complete_responses"].append(row)
        elif write_state:
            out["pending_responses"].append(row)
    yield _report(out.values())


# --------------------------------------------------------------------------- learning and notifications

def learn_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Partial learning summaries per (dbid, collection): small, merged on the driver."""
    from entity_assets.learning import Summary

    summaries: dict[tuple[str, str], Summary] = {}
    for row in _rows(batches):
        doc = json.loads(row["after"])
        if isinstance(doc, dict):
            summaries.setdefault((row["dbid"], row["collection"]), Summary()).observe(doc)
    yield pa.RecordBatch.from_pylist(
        [{"dbid": d, "collection": c, "summary": s.to_json()} for (d, c), s in summaries.items()],
        schema=pa.schema([("dbid", pa.string()), ("collection", pa.string()), ("summary", pa.string())]),
    )


def copy_task(batches: Iterator[pa.RecordBatch], *, target: str, slice_key: str, uris: dict[str, str],
              storage_options) -> Iterator[pa.RecordBatch]:
    """Writes the input rows (already of this slice) to the `target` table unchanged."""
    out = Writers(slice_key, uris, storage_options)
    for batch in batches:
        out[target].write_table(pa.Table.from_batches([batch]))
    yield _report(out.values())


def fan_out_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options,
                 subscriptions: list[tuple[str, str, str]]) -> Iterator[pa.RecordBatch]:
    """Input: the slice's zone changes; subscriptions: (dbid, entity, document JSON) in effect."""
    index = notify.SubscriptionIndex(
        (dbid, entity, sub) for dbid, entity, doc in subscriptions
        if (sub := notify.parse_subscription(json.loads(doc))) is not None
    )
    out = Writers(slice_key, uris, storage_options)
    lineage = ("kafka_topic", "kafka_partition", "kafka_offset", "kafka_timestamp")
    for change in _rows(batches):
        for row in notify.fan_out(change, index):
            out["changes_by_device"].append({**row, "slice": slice_key, **{c: change[c] for c in lineage}})
    yield _report(out.values())


def inbox_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options,
               state_files: dict[int, list[str]], write_state: bool) -> Iterator[pa.RecordBatch]:
    """Input: notifications and acks of the slice, sorted by (bucket, device, kind, ended).

    A device's new notifications apply before its acks (kind "a-notify" < "b-ack").
    """
    out = Writers(slice_key, uris, storage_options)
    store = BucketStore(out["device_inboxes"], ("device",), state_files, write_state)
    device, inbox, dirty = None, None, False

    def flush():
        if dirty:
            out["device_notifications"].append({"slice": slice_key, **_message_row(inbox)})
            store.put((device,), {"slice": slice_key, "dbid": inbox.dbid, "user": inbox.user, "device": device,
                                  "version": 0, "deleted": False, "document": inbox.to_json(),
                                  "ended": inbox.ended, "bucket": store.bucket})

    for row in _rows(batches):
        if row["device"] != device:
            flush()  # into the previous device's bucket, so switch buckets only after it is stored
            store.switch(row["bucket"])
            device, dirty = row["device"], False
            stored = store.get((device,))
            inbox = (notify.DeviceInbox.from_json(stored["document"]) if stored
                     else notify.DeviceInbox(row["dbid"], row["user"], device))
        if row["kind"] == "a-notify":
            inbox.add(row["notification"], row["ended"])
            dirty = True
        else:
            ids = json.loads(row["notifications"]) if row["notifications"] else None
            dirty = inbox.ack(ids, row["upTo"]) > 0 or dirty
    flush()
    store.close()
    yield _report(out.values())


def _message_row(inbox) -> dict:
    msg = inbox.message()
    return {k: msg[k] for k in ("dbid", "user", "device", "count", "begun", "ended")}
