"""Spark task bodies (no Dagster imported).

Each reports the data files it wrote and its counters as `FILES_SCHEMA` records. Tasks
read their inputs from parquet themselves (`over_files`, `over_buckets`, `fold_task`), so
Spark only schedules them: no row shuffle, no JVM scan. State tables (entities,
schemas, devices, device inboxes) are hash-bucketed: a task owns whole buckets, reads the state
files holding the slice's keys, folds the slice's rows in order and writes back the files
holding changed keys: a MERGE done as copy-on-write of the touched files (see `shards`),
committed by the driver in one Delta transaction.
"""

from __future__ import annotations

import ctypes
import json
from collections import Counter
from collections.abc import Iterator
from itertools import groupby
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from entity_assets import core, encode, notify, shards
from entity_assets.learning import new_declaration_error
from entity_assets.publish import UNDELIVERABLE, Publisher, Publishing
from entity_assets.storage import (REQUESTS_IN_FLIGHT, FileWriter, RowGroups, TableFile, files_ahead, from_rows, is_remote,
                                   key_string, key_strings, prefetched, read_files, read_table, read_tables, to_rows)
from entity_assets.tables import COORDINATES, SCHEMAS

FILES_SCHEMA = pa.schema([("table", pa.string()), ("path", pa.string()), ("size", pa.int64()),
                          ("rows", pa.int64()), ("stats", pa.string())])

COUNTER = "count:"
"""Report rows whose table starts with this are counters (rows = the count), not files."""
APP_VERSION = "app_version:"
"""Counters of devices_task: the change of an app version's device count in the slice."""
REPLACED = "replaced:"
"""Report rows whose table starts with this name a state file (path: its URI) that the task rewrote."""


SUCCESSES_ONLY = frozenset({"entity_updates"})
"""Update streams that hold the successful patches only: the seed says so of entity-updates
("the only responses recorded ... are those for which the corresponding patch was successfully
applied"), while schema-updates is "a durable record of all schema patch requests received",
its `status` 1 or 3 and `error` where not 1."""


class Outputs:
    """What a task writes: one FileWriter per table, the messages it publishes, and counters.

    Every row goes through `emit` (`emit_rows` for rows in Arrow, `respond` for a fold's results),
    which writes it and, for a published table, spools its message (published by the step once
    the rows are committed).
    """

    def __init__(self, slice_key: str, uris: dict[str, str], storage_options, publishing: Publishing | None = None,
                 row_groups_by: dict[str, str] | None = None, updates: str | None = None,
                 whole_keys: dict[str, str] | None = None):
        """`updates`: the table of the results that `respond` takes (entity_updates, of status 1 only,
        or schema_updates: `SUCCESSES_ONLY`); `whole_keys`: per table, the key column whose rows a file never splits
        (`FileWriter`)."""
        self.slice_key, self.uris, self.storage_options = slice_key, uris, storage_options
        self.row_groups_by = row_groups_by or {}
        self.whole_keys = whole_keys or {}
        self.writers: dict[str, FileWriter] = {}
        self.publisher = Publisher(publishing) if publishing and publishing.topics else None
        self.counts: dict[str, int] = {}
        self.replaced: list[dict] = []
        self.updates = updates
        self._results: list[dict] = []
        self._batched: dict[str, list[dict]] = {}
        self._batched_bytes: dict[str, int] = {}

    def writer(self, table: str) -> FileWriter:
        w = self.writers.get(table)
        if w is None:
            stats = ("slice", "bucket") if "bucket" in SCHEMAS[table].names else ("slice",)
            w = self.writers[table] = FileWriter(table, self.uris[table], SCHEMAS[table], self.slice_key,
                                                 stats_columns=stats, storage_options=self.storage_options,
                                                 row_groups_by=self.row_groups_by.get(table),
                                                 whole_keys=self.whole_keys.get(table))
        return w

    def emit(self, table: str, row: dict, size: int = 0) -> None:
        """Rows of a published table are held until `BATCH_ROWS` of them are, or `RESULT_TEXT_BYTES`
        of their text (`size`: a row's, where it may be large): one conversion to Arrow then
        serves the file and the messages, made a batch at a time (`Publisher.send_rows`).
        """
        if self.publisher is not None and self.publisher.publishes(table):
            rows = self._batched.setdefault(table, [])
            rows.append(row)
            held = self._batched_bytes[table] = self._batched_bytes.get(table, 0) + size
            if len(rows) >= BATCH_ROWS or held > RESULT_TEXT_BYTES:
                self._write_batched(table)
            return
        self.writer(table).append(row, size)

    def emit_rows(self, table: str, rows: pa.Table, texts: pa.Array | None = None) -> None:
        """`emit` of rows held in Arrow (columns by name); `texts`: their messages, when made already."""
        if rows.num_rows:
            self.writer(table).append_table(rows)
            if self.publisher is not None:
                self.publisher.send_rows(table, rows, texts)

    def publish_rows(self, table: str, rows: pa.Table, texts: pa.Array | None = None) -> None:
        """Spools the messages of rows written elsewhere, whose writers split a key's rows: the
        fold publishes entity_patches in the order it applies them, the inbox fold
        changes_by_device in each device's order, complete_task the partial responses of
        multi-part requests in part order. `texts`: their messages, when made already."""
        if rows.num_rows and self.publisher is not None:
            self.publisher.send_rows(table, rows, texts)

    def _write_batched(self, table: str) -> None:
        self._batched_bytes.pop(table, None)
        self.emit_rows(table, pa.Table.from_batches([from_rows(self._batched.pop(table), self.writer(table).struct)]))

    def respond(self, result: dict) -> None:
        """A processed part, as a result row (`respond_rows` of those held, per `BATCH_ROWS`): the
        schema fold's, whose rows have the partial-responses columns (an entity update also
        carries its bucket, which the entity fold's Arrow rows have)."""
        self._results.append(result)
        if len(self._results) >= BATCH_ROWS:
            self._respond_held()

    def flush_held(self, tables: tuple[str, ...] | None = None) -> None:
        """What is held as dicts, made Arrow and written now: the results, the rows batched for
        publishing, and the rows of `tables`' writers (None: all; a stream table gains a file)."""
        self._respond_held()
        for table in list(self._batched):
            self._write_batched(table)
        for table, w in self.writers.items():  # every table's last file on its way before any is waited for
            if tables is None or table in tables:
                w.flush()

    def _respond_held(self) -> None:
        if self._results:
            rows, self._results = self._results, []
            self.respond_rows(pa.Table.from_batches([from_rows(rows, self.writer("partial_responses").struct)]))

    def respond_rows(self, data: pa.Table, learned: pa.Array | None = None) -> None:
        """Processed parts of one stream, as result rows in Arrow: their updates (status 1), their partial
        responses, the complete responses of single-part requests, and the schema-learning
        messages of the rows where `learned` (their `after` there: `core.learned_after`) is set.

        Requests of several parts are completed by `complete_task`, which groups their parts and
        publishes their partial responses, a request's in part order (its parts are in several
        buckets, so several tasks here). One batch of message texts (`encode`) serves the four tables.
        """
        if not data.num_rows:
            return
        status, parts = data.column("status"), data.column("parts")
        stream = data.column("stream")[0].as_py()
        for count in pc.value_counts(status).to_pylist():
            self.count(f"status:{stream}:{count['values']}", count["counts"])
        single = pc.equal(parts, 1)
        if (multipart := data.num_rows - pc.sum(single).as_py()):
            self.count("multipart", multipart)
        ok = pc.equal(status, core.STATUS_OK)
        all_ok = pc.all(ok).as_py()
        complete = _where(data, single, not multipart)
        publisher = self.publisher
        if publisher is None or not (publisher.publishes("partial_responses") or publisher.publishes(self.updates)):
            # only the complete responses need the texts
            texts, responses = None, encode.result_texts(complete)
        else:
            texts = encode.result_texts(data)
            responses = _where(texts, single, not multipart)
        if multipart:  # written here, published by complete_task
            self.writer("partial_responses").append_table(data)
            self.publish_rows("partial_responses", complete, responses)
        else:
            self.emit_rows("partial_responses", data, texts)
        if self.updates not in SUCCESSES_ONLY:
            self.emit_rows(self.updates, data, texts)
        else:
            self.emit_rows(self.updates, _where(data, ok, all_ok), None if texts is None else _where(texts, ok, all_ok))
        self.emit_rows("complete_responses",
                       complete.append_column("responses", pc.binary_join_element_wise("[", responses, "]", "")))
        if learned is not None and learned.null_count < len(learned):  # the update's row, its document as `after`
            learning, every = pc.is_valid(learned), not learned.null_count
            rows = _where(data, learning, every)
            rows = rows.set_column(rows.schema.get_field_index("after"), "after", _where(learned, learning, every))
            self.emit_rows("schema_learning", rows.append_column("kind", pa.repeat(pa.scalar("entity"), rows.num_rows)))

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def close_state(self, table: str, store: BucketStore) -> None:
        """Writes the store's last bucket and reports the state files its rewrites replace."""
        store.close()
        self.replaced += [{"table": REPLACED + table, "path": f.uri, "size": 0, "rows": 0, "stats": ""}
                          for f in store.replaced]
        self.count(f"check:repeated_keys:{table}", store.repeated_keys)

    def report(self) -> list[dict]:
        """The files written (the outbox spool included: see publish.OUTBOX) and the counters."""
        self.flush_held()
        files = [f.to_dict() for w in self.writers.values() for f in w.close()]
        spool, undeliverable = None, []
        if self.publisher is not None:
            spool, undeliverable = self.publisher.close(), self.publisher.undeliverable_report()
            for table, n in self.publisher.undeliverable.items():
                self.count(UNDELIVERABLE + table, n)
        return files + ([spool] if spool else []) + undeliverable + self.replaced + [
            {"table": COUNTER + name, "path": "", "size": 0, "rows": n, "stats": ""} for name, n in self.counts.items()]


BATCH_ROWS = 20_000
"""Results, and rows whose messages are made a batch at a time, held as dicts before their one
conversion to Arrow (`Outputs.respond`, `Outputs.emit`); the entity fold's batches of patches."""
RESULT_TEXT_BYTES = 128 * 1024 * 1024
"""The text (ops, and the documents asked for: `before`, `after`, learning's; characters, up to
4 bytes each) that a batch of results holds at most: a column of text holds 2 GiB, and with
documents of up to 16 Mi characters, a batch of `BATCH_ROWS` would pass it; past this, the
fold's batch is cut where it is."""


def _where(values, mask, every: bool):
    """`values.filter(mask)`, or `values` itself when `every` row is kept: a filter copies them all."""
    return values if every else values.filter(mask)


def _arrow(report: list[dict]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(report, schema=FILES_SCHEMA)


def released(body, tasks: Iterator) -> Iterator:
    """Runs a task body (any mapPartitions function), then returns the heap it freed to the OS.

    glibc keeps freed heap for the process's next allocations, so a Spark worker that runs one
    task after another kept the peak of each and grew from task to task (bench/README.md,
    bench_ingest memory). `malloc_trim` exists on glibc only: elsewhere this does nothing.
    """
    yield from body(tasks)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _rows(batches: Iterator[pa.RecordBatch]) -> Iterator[dict]:
    for batch in batches:
        yield from to_rows(batch)


def _buckets(batches: Iterator[pa.RecordBatch], key_columns: tuple[str, ...]) -> Iterator[tuple[int, list[dict], pa.Array]]:
    """Input sorted by bucket, one bucket at a time: (bucket, its rows, the `key_strings` of their keys).

    A store then reads only the stored rows of those keys (`BucketStore.switch`).
    """
    def group(bucket, rows):
        keys = {key_string(tuple(r[c] for c in key_columns)) for r in rows}
        return bucket, rows, pa.array(sorted(keys), pa.string())

    bucket, rows = None, []
    for row in _rows(batches):
        if row["bucket"] != bucket and rows:
            yield group(bucket, rows)
            rows = []
        bucket = row["bucket"]
        rows.append(row)
    if rows:
        yield group(bucket, rows)


class Fetched(NamedTuple):
    """A bucket's stored rows that `BucketStore.switch` reads (`BucketStore.fetch`)."""
    bucket: int
    wanted: pa.Array | None
    files: dict[shards.Shard, list[TableFile]]
    owners: shards.ShardMap
    loaded: dict[shards.Shard, tuple[pa.Table, pa.ChunkedArray]]


class BucketStore:
    """The rows of one bucketed state table that a task owns, one bucket at a time.

    A bucket is stored as shards (see `shards`): only the files holding the slice's keys are
    read, and only those holding changed keys are rewritten. Their stored rows stay in Arrow:
    only the rows of the slice's keys become dicts, the untouched ones are written back
    without leaving Arrow. `replaced` lists the files the rewrites replace, for the driver.
    """

    def __init__(self, writer: FileWriter, key_columns: tuple[str, ...], state_files: dict[int, list[TableFile]], enabled: bool,
                 storage_options=None, file_rows: int = shards.FILE_ROWS):
        self.writer, self.key_columns, self.state_files, self.enabled = writer, key_columns, state_files, enabled
        self.storage_options, self.file_rows = storage_options, file_rows
        self.bucket, self.stored, self.changed = None, {}, {}
        self.files: dict[shards.Shard, list[TableFile]] = {}
        self.loaded: dict[shards.Shard, tuple[pa.Table, pa.ChunkedArray]] = {}
        self.map = shards.ShardMap(())
        self.replaced: list[TableFile] = []
        self.repeated_keys = 0
        """Rows written whose key another written row of the bucket has (must stay 0)."""

    def fetch(self, bucket: int, wanted: pa.Array | None = None) -> Fetched:
        """Reads what `switch` needs of `bucket`: only reads, so it may run in another thread
        (`storage.prefetched`) while the task folds the bucket before it."""
        files: dict[shards.Shard, list[TableFile]] = {}
        for f in self.state_files.get(bucket, []):
            files.setdefault(shards.of_file(f.path), []).append(f)
        owners = shards.ShardMap(files)
        if wanted is None:
            needed = set(files)
        else:
            needed = {owners.owner(shards.key_hash(k)) for k in wanted.to_pylist()} & files.keys()
        return Fetched(bucket, wanted, files, owners, {shard: self._read(files[shard]) for shard in sorted(needed)})

    def switch(self, bucket: int, wanted: pa.Array | None = None, fetched: Fetched | None = None) -> None:
        """Loads `bucket`; `wanted`: the `key_strings` of the keys to be read (None: every key);
        `fetched`: what `fetch` read of them already."""
        if bucket == self.bucket:
            return
        self.close()
        fetched = fetched or self.fetch(bucket, wanted)
        self.bucket, self.changed, self.stored = bucket, {}, {}
        self.files, self.map, self.loaded = fetched.files, fetched.owners, fetched.loaded
        for data, keys in self.loaded.values():
            self._keep(data, keys, fetched.wanted)

    def _read(self, files: list[TableFile]) -> tuple[pa.Table, pa.ChunkedArray]:
        data = pa.concat_tables(read_tables(files, self.storage_options))
        return data, key_strings(data, self.key_columns)

    def _keep(self, data: pa.Table, keys: pa.ChunkedArray, wanted: pa.Array | None) -> None:
        for row in to_rows(data if wanted is None else data.filter(pc.is_in(keys, value_set=wanted))):
            self.stored[tuple(row[c] for c in self.key_columns)] = row

    def get(self, key: tuple) -> dict | None:
        return self.changed.get(key) or self.stored.get(key)

    def put(self, key: tuple, row: dict) -> None:
        self.changed[key] = row

    def close(self) -> None:
        """Writes back each shard holding a changed key, split where it outgrows `file_rows`."""
        if self.bucket is None or not self.enabled or not self.changed:
            return
        strings = [key_string(key) for key in self.changed]
        touched: dict[shards.Shard, list[tuple[int, dict]]] = {}
        for string, row in zip(strings, self.changed.values()):
            h = shards.key_hash(string)
            touched.setdefault(self.map.owner(h), []).append((h, row))
        changed_keys = pa.array(strings, pa.string())
        for shard in sorted(touched):
            kept, kept_keys = self.writer.schema.empty_table(), pa.chunked_array([], pa.string())
            if shard in self.files:
                if shard not in self.loaded:
                    self.loaded[shard] = self._read(self.files[shard])
                data, keys = self.loaded[shard]
                untouched = pc.invert(pc.is_in(keys, value_set=changed_keys))
                kept, kept_keys = data.filter(untouched), keys.filter(untouched)
                self.repeated_keys += len(kept_keys) - pc.count_distinct(kept_keys).as_py()
                self.replaced += self.files[shard]
            self._write(shard, kept, kept_keys, touched[shard])
        self.changed = {}  # written: closing again writes nothing

    def _write(self, shard: shards.Shard, kept: pa.Table, kept_keys: pa.ChunkedArray, rows: list[tuple[int, dict]]) -> None:
        """The shard's rows as one file, or split into files of at most `file_rows` rows and about
        `shards.FILE_BYTES` (large documents: fewer rows a file)."""
        count = kept.num_rows + len(rows)
        size = kept.nbytes + sum(len(row.get("document") or "") for _, row in rows)
        limit = min(self.file_rows, max(1, count * shards.FILE_BYTES // max(size, 1)))
        if count <= limit:
            self.writer.write_table(kept, [row for _, row in rows], tag=shard.tag)
            return
        hashes = [shards.key_hash(k) for k in kept_keys.to_pylist()] + [h for h, _ in rows]
        for part, positions in shards.split(shard, hashes, limit):
            old = [i for i in positions if i < kept.num_rows]
            self.writer.write_table(kept.take(pa.array(old, pa.int64())), [rows[i - kept.num_rows][1] for i in positions[len(old):]],
                                    tag=part.tag)


# --------------------------------------------------------------------------- bucketed folds over files

SortKey = tuple[str, ...]


def key_buckets(data: pa.Table, key_columns: SortKey) -> pa.Array:
    """Each row's state bucket: `core.key_bucket` of its key columns joined by \\x1f (nulls skipped),
    computed once per distinct key."""
    joined = pc.binary_join_element_wise(*[pc.cast(data.column(c), pa.string()) for c in key_columns], "\x1f",
                                         null_handling="skip")
    keys = pc.unique(joined)
    buckets = pa.array([core.key_bucket(k) for k in keys.to_pylist()], pa.int32())
    return pc.take(buckets, pc.index_in(joined, value_set=keys))


def over_buckets(tasks: Iterator[dict], *, body, sources: dict[str, list[TableFile]], reader, key_columns: SortKey,
                 order: SortKey, storage_options, **kwargs) -> Iterator[dict]:
    """Runs a bucketed fold `body` over the rows of each task's buckets ({"buckets"}), for `run_tasks`.

    The task reads every file of `sources` ({table: committed files}) itself, through `reader(table,
    file, storage_options, buckets)` (a file's rows in the body's columns; `buckets`, the task's, let
    a reader of files with row groups by bucket skip the others), keeps its buckets' rows and
    sorts them by (bucket, *order), as the body expects. Spark only schedules the tasks: no
    shuffle, no JVM scan. On an object store the files are read at once (`storage.files_ahead`):
    the task holds all their rows anyway.
    """
    sort = [(c, "ascending", "at_start") for c in ("bucket",) + tuple(order)]  # nulls first, as Spark sorts
    inputs = [(table, file) for table, files in sources.items() for file in files]
    ahead = files_ahead(file for _, file in inputs)
    for task in tasks:
        wanted = pa.array(task["buckets"], pa.int32())
        parts = []
        for data in prefetched(lambda input: reader(*input, storage_options, task["buckets"]), inputs, ahead):
            buckets = key_buckets(data, key_columns)
            parts.append(data.append_column("bucket", buckets).filter(pc.is_in(buckets, value_set=wanted)))
        if not parts:
            continue
        # permissive: a state file of an older layout lacks later columns (null, as a Spark read gives)
        rows = pa.concat_tables(parts, promote_options="permissive")
        for report in body(sorted_batches(rows, sort), storage_options=storage_options, **kwargs):
            yield from to_rows(report)


SORT_WHOLE_BYTES = 1 << 30
"""A task's rows up to this many bytes are sorted whole; more, a batch at a time (`sorted_batches`)."""
SORTED_BATCH_BYTES = 256 << 20
"""A batch's text at most, past `SORT_WHOLE_BYTES`: 20,000 rows of 110 KB would pass 2 GiB."""


def sorted_batches(rows: pa.Table, sort: list[tuple], size: int = 20_000) -> Iterator[pa.RecordBatch]:
    """`rows` in `sort` order, `size` rows a batch. Sorted whole, a column of text past the 2 GiB
    an Arrow array holds (a task's multi-part requests with their documents) would not fit: a
    large table's batches are each taken from the chunks that hold their rows."""
    if rows.nbytes < SORT_WHOLE_BYTES:
        yield from rows.sort_by(sort).to_batches(max_chunksize=size)
        return
    order = pc.sort_indices(rows, sort_keys=sort).to_numpy().astype(np.int64)
    chunks = rows.to_batches()
    starts = np.cumsum([0] + [c.num_rows for c in chunks])
    texts = [c for c in rows.columns if pa.types.is_string(c.type) or pa.types.is_binary(c.type)]
    row_bytes = sum((pc.binary_length(c).fill_null(0).to_numpy().astype(np.int64) for c in texts),
                    np.full(rows.num_rows, 64, np.int64))[order]  # a row's text, and its other columns roughly
    ends = np.cumsum(row_bytes)
    begin = 0
    while begin < len(order):  # batches of `size` rows at most, and of SORTED_BATCH_BYTES but for one row
        before = ends[begin - 1] if begin else 0
        end = min(begin + size, max(begin + 1, int(np.searchsorted(ends, before + SORTED_BATCH_BYTES, side="right"))))
        wanted, begin = order[begin:end], end
        chunk_of = np.searchsorted(starts, wanted, side="right") - 1
        pieces, places = [], []
        for chunk in np.unique(chunk_of):
            mine = np.flatnonzero(chunk_of == chunk)
            pieces.append(chunks[chunk].take(pa.array(wanted[mine] - starts[chunk])))
            places.append(mine)
        taken = pa.Table.from_batches(pieces).combine_chunks()
        yield from taken.take(pa.array(np.argsort(np.concatenate(places), kind="stable"))).to_batches()


def connection_rows(table: str, file: TableFile, storage_options, buckets: list[int]) -> pa.Table:
    """`devices_task`'s input: the columns of a connections file it folds."""
    return read_table(file, storage_options, [*notify.DEVICE_KEY, "clientid", "appVersion", "begun"])


INBOX_EVENTS = pa.schema([("dbid", pa.string()), ("user", pa.string()), ("device", pa.string()),
                          ("kind", pa.string()), ("notification", pa.string()), ("ended", pa.int64()),
                          ("notifications", pa.string()), ("upTo", pa.int64()), ("collection", pa.string()),
                          ("zone", pa.string()), ("entity", pa.string()), ("action", pa.string()),
                          *((c, SCHEMAS["changes_by_device"].field(c).type) for c in core.ORDER)])
INBOX_ORDER = ("device", "kind", *core.ORDER, "ended", "notification")
"""A device's acks by time, then its new notifications in the order the fold applied their
changes (`core.ORDER`): `ended` and the notification id order the rows of an older lake, whose
changes_by_device rows lack the request columns."""
ACK, NOTIFY = "a-ack", "b-notify"
"""Kinds of inbox events: a device's acks sort before its new notifications, which no ack of the
slice can have seen (they are published after the slice closed): an `upTo` covers only the
notifications of earlier slices, not one of this slice that `ended` at or before it."""


def inbox_events(table: str, file: TableFile, storage_options, buckets: list[int]) -> pa.Table:
    """`inbox_task`'s input: acks (notification_acks, kind ACK, at their `begun`) and new
    notifications (changes_by_device, kind NOTIFY) in one layout.

    changes_by_device files hold a row group per inbox bucket (`fan_out_task`): a task decodes
    only its buckets' rows, so the step reads the slice's notifications once, whatever its tasks.
    """
    if table == "changes_by_device":  # with what its change summary says, which the task publishes
        data = read_table(file, storage_options, ["dbid", "user", "device", "notification", "ended", "collection",
                                                  "zone", "entity", "action", *core.ORDER],
                          filters=[("bucket", "in", buckets)], schema=SCHEMAS[table])  # an older file: no request
        kind = NOTIFY
    else:
        data = read_table(file, storage_options, ["dbid", "user", "device", "begun", "notifications", "upTo"])
        data = data.rename_columns(["dbid", "user", "device", "ended", "notifications", "upTo"])
        kind = ACK
    columns = {name: data.column(name) if name in data.column_names else pa.nulls(data.num_rows, INBOX_EVENTS.field(name).type)
               for name in INBOX_EVENTS.names}
    columns["kind"] = pa.array([kind] * data.num_rows, pa.string())
    return pa.table(columns, schema=INBOX_EVENTS)


def multipart_parts(table: str, file: TableFile, storage_options, buckets: list[int]) -> pa.Table:
    """`complete_task`'s input: the parts of multi-part requests, from partial_responses files
    (whose row groups of single-part results are skipped by their statistics: RESULT_ROW_GROUPS)
    and pending_responses."""
    return read_table(file, storage_options, filters=[("parts", ">", 1)] if table == "partial_responses" else None)


def schema_patch_rows(table: str, file: TableFile, storage_options, buckets: list[int], *,
                      redelivered: frozenset = frozenset()) -> pa.Table:
    """`schema_fold_task`'s input: a schema_patches file without its redeliveries (Kafka coordinates)."""
    data = read_table(file, storage_options)
    return data.filter(not_redelivered(data, redelivered)) if redelivered else data


def not_redelivered(rows: pa.Table, redelivered: frozenset) -> pa.Array:
    """The mask of `rows` that are no redelivery: whose `COORDINATES` are not in `redelivered`."""
    return pa.array([at not in redelivered for at in zip(*(rows.column(c).to_pylist() for c in COORDINATES))],
                    pa.bool_())


# --------------------------------------------------------------------------- entity core

def explode_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options,
                 redelivered: frozenset, publishing: Publishing | None = None) -> Iterator[pa.RecordBatch]:
    """Input: entity_batches rows of the slice. Skips redelivered batches (by Kafka coordinates).

    entity_patches files get one row group per state bucket, so each fold task reads only its buckets.
    """
    out = Outputs(slice_key, uris, storage_options, publishing, row_groups_by={"entity_patches": "bucket"})
    types = SCHEMAS["entity_patches"]
    for batch in batches:
        rows = pa.Table.from_batches([batch])
        if redelivered:
            kept = not_redelivered(rows, redelivered)
            if not pc.all(kept).as_py():
                out.count("redelivered", rows.num_rows - pc.sum(kept).as_py())
                rows = rows.filter(kept)
        if not rows.num_rows:
            continue
        out.count("batches", rows.num_rows)
        at, patches = [], []
        for i, (dbid, text) in enumerate(zip(rows.column("dbid").to_pylist(), rows.column("patches").to_pylist())):
            own = core.explode(dbid, text)
            at += [i] * len(own)
            patches += own
        # the batch's columns taken once per patch, the patch's own columns added: no row becomes a dict
        exploded = rows.select(core.PATCH_FROM_BATCH).take(pa.array(at, pa.int64()))
        for name, values in zip(core.PATCH_FIELDS, zip(*patches) if patches else [()] * len(core.PATCH_FIELDS)):
            exploded = exploded.append_column(name, pa.array(values, types.field(name).type))
        out.emit_rows("entity_patches", exploded)
    yield _arrow(out.report())


_FOLD_READS = ("dbid", "collection", "zone", "entity", "kafka_timestamp", "begun", "ops", "includeBefore", "includeAfter",
               "learning")
_FOLD_ADDS = ("ended", *core.RESULT_FIELDS, "subjectZone", "leftZone", "previousSlice")
_RESULT_TYPES = SCHEMAS["entity_updates"]

RESULT_ROW_GROUPS = {"entities": "collection", "partial_responses": "parts"}
"""Row groups by value: the subscriptions in effect are read from the entity state's
`$zoneSubscription` row groups, and the parts of multi-part requests (`multipart_parts`) from
the partial_responses row groups of `parts` > 1, the others skipped by their statistics."""


UPDATES_WHOLE = {"entity_updates": "entity"}
"""An entity's updates stay in one file: zone_changes' tasks split the files, and publish each
entity's zone changes in the order of its updates."""

PREFETCH_BYTES = 64 << 20
"""State file bytes a task reads ahead of its fold at most (`prefetch_depth`)."""


def prefetch_depth(state_uri: str, state_files: dict[int, list[TableFile]]) -> int:
    """Buckets a fold task reads ahead on an object store: as many as `PREFETCH_BYTES` of the
    largest bucket's state files allow, up to `REQUESTS_IN_FLIGHT`; 0 on a local disk, where a
    read is no round trip and the task's core is busy folding."""
    if not is_remote(state_uri):
        return 0
    largest = max((sum(f.size for f in files) for files in state_files.values()), default=0)
    return max(1, min(REQUESTS_IN_FLIGHT, PREFETCH_BYTES // max(largest, 1)))


def fold_task(tasks: Iterator[dict], *, slice_key: str, uris: dict[str, str], storage_options, patch_files: list[TableFile],
              state_files: dict[int, list[TableFile]], write_state: bool, state_file_rows: int = shards.FILE_ROWS,
              publishing: Publishing | None = None) -> Iterator[dict]:
    """Tasks: {"buckets"}: the state buckets a task owns; it folds the slice's patches of each, in order."""
    order = [(c, "ascending") for c in core.ENTITY_KEY + core.ORDER]
    ahead = prefetch_depth(uris["entities"], state_files)
    for task in tasks:
        out = Outputs(slice_key, uris, storage_options, publishing, row_groups_by=RESULT_ROW_GROUPS,
                      updates="entity_updates", whole_keys=UPDATES_WHOLE)
        store = BucketStore(out.writer("entities"), core.ENTITY_KEY, state_files, write_state, storage_options,
                            state_file_rows)
        slice_patches = RowGroups(patch_files, "bucket", storage_options)  # each footer read once per task

        def inputs(bucket: int) -> tuple[pa.Table, Fetched | None]:
            patches = slice_patches.read(bucket)
            return patches, store.fetch(bucket, pc.unique(key_strings(patches, core.ENTITY_KEY))) if patches.num_rows else None

        for patches, fetched in prefetched(inputs, task["buckets"], ahead):
            if patches.num_rows:
                store.switch(fetched.bucket, fetched=fetched)
                _fold_bucket(out, store, patches.sort_by(order), fetched.bucket, slice_key)
        out.close_state("entities", store)
        yield from out.report()


def _fold_bucket(out: Outputs, store: BucketStore, patches: pa.Table, bucket: int, slice_key: str) -> None:
    """Folds one bucket's patches, sorted by entity and `core.ORDER`, over the entities `store` holds."""
    key, state, previous = None, core.DocState(), None

    def save():  # an entity's state row is made once, after its last patch of the slice
        if state.changed:
            store.put(key, state.row(dict(zip(core.ENTITY_KEY, key)), slice_key, bucket))

    for batch in patches.to_batches(max_chunksize=BATCH_ROWS):
        if not batch.num_rows:
            continue
        # results stay in Arrow: the patch's columns, and the columns the fold adds
        added, learned, start, texts = [], [], 0, 0
        for i, (dbid, collection, zone, entity, timestamp, begun, ops, include_before, include_after, learning) in \
                enumerate(zip(*(batch.column(name).to_pylist() for name in _FOLD_READS))):
            k = (dbid, collection, zone, entity)
            if k != key:
                save()
                stored = store.get(k)
                key, state, previous = k, core.DocState(stored), stored and stored["slice"]
            before = state.doc
            ended = core.ended_of(timestamp, begun)
            status, error, before_text, after, action = core.apply(state, ops, ended, include_before, include_after)
            subject = left = learn = None
            if status == core.STATUS_OK:
                subject, left = notify.subject_zones(collection, zone, state.doc, before)
                if learning and state.doc is not None:
                    learn = core.learned_after(after, state.doc)
            texts += len(ops) + len(before_text or "") + len(after or "") + len(learn or "")  # what its messages hold
            added.append((ended, status, error, before_text, after, action, subject, left, previous))
            learned.append(learn)
            if texts > RESULT_TEXT_BYTES:  # documents asked for that would outgrow a column of text
                _respond(out, batch.slice(start, i + 1 - start), added, learned)
                added, learned, start, texts = [], [], i + 1, 0
        if added:
            _respond(out, batch.slice(start), added, learned)
    save()


def _respond(out: Outputs, batch: pa.RecordBatch, added: list[tuple], learned: list[str | None]) -> None:
    """The results of `batch`'s patches, in Arrow: its columns and those the fold adds."""
    results = pa.Table.from_batches([batch])
    out.publish_rows("entity_patches", results)
    for name, values in zip(_FOLD_ADDS, zip(*added)):
        results = results.append_column(name, pa.array(values, _RESULT_TYPES.field(name).type))
    results = results.append_column("stream", pa.repeat(pa.scalar("entity-updates"), batch.num_rows))
    out.respond_rows(results, pa.array(learned, pa.string()))


def schema_fold_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options,
                     state_files: dict[int, list[TableFile]], write_state: bool, state_file_rows: int = shards.FILE_ROWS,
                     publishing: Publishing | None = None) -> Iterator[pa.RecordBatch]:
    """Input: the slice's schema patches, sorted by (bucket, dbid, core.ORDER)."""
    out = Outputs(slice_key, uris, storage_options, publishing, row_groups_by=RESULT_ROW_GROUPS, updates="schema_updates")
    store = BucketStore(out.writer("schemas"), ("dbid",), state_files, write_state, storage_options, state_file_rows)
    held = 0  # the text the outputs hold, over every bucket of the task
    for bucket, patches, keys in _buckets(batches, ("dbid",)):
        store.switch(bucket, keys)
        dbid, state = None, None
        for patch in patches:
            if patch["dbid"] != dbid:
                dbid, state = patch["dbid"], core.DocState(store.get((patch["dbid"],)))
            result = core.apply_one(state, patch, implicit_empty=True, check=new_declaration_error)
            result["stream"] = "schema-updates"
            held += len(patch["ops"]) + len(result["before"] or "") + len(result["after"] or "")
            if result["status"] == core.STATUS_OK:
                for row in core.entity_type_rows(result, state.doc or {}):  # the schema again, a type a row
                    out.emit("schema_learning", row)
                    held += len(row["after"])
                store.put((dbid,), state.row({"dbid": dbid}, slice_key, bucket))
            out.respond(result)
            if held > RESULT_TEXT_BYTES:  # a column of text holds 2 GiB
                out.flush_held(("schema_learning",))
                held = 0
    out.close_state("schemas", store)
    yield _arrow(out.report())


EXPIRED_REQUEST = "expired_request:"
"""complete_task's counter of requests that waited their slices in vain, and the prefix of the
counters that name the first of them (one per request, `SHOWN_EXPIRED` a task)."""
SHOWN_EXPIRED = 20


def complete_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str],
                  storage_options, write_state: bool, wait_slices: int | None = None,
                  publishing: Publishing | None = None) -> Iterator[pa.RecordBatch]:
    """Input: this slice's parts of multi-part requests plus pending parts, sorted by (clientid,
    request, stream, part). It publishes this slice's parts (their partial responses), each
    request's in part order. A request incomplete after `wait_slices` slices leaves the pending
    parts, counted and named."""
    out = Outputs(slice_key, uris, storage_options, publishing)
    batches = _published_as_read(out, batches, "partial_responses", "slice", slice_key)  # not the pending parts
    expired = 0
    for kind, row in core.split_complete(core.group_requests(_rows(batches)), slice_key, wait_slices):
        if kind == "complete":
            out.emit("complete_responses", row, len(row["responses"]))
            out.count("check:incomplete", int(len(json.loads(row["responses"])) != row["parts"]))
        elif kind == "expired":
            out.count(EXPIRED_REQUEST)
            if expired < SHOWN_EXPIRED:
                out.count(f"{EXPIRED_REQUEST}{row['clientid']}/{row['request']}: parts {row['received']} "
                          f"of {row['parts']}, the first in slice {row['since']}")
            expired += 1
        elif write_state:
            out.emit("pending_responses", row, sum(len(row.get(c) or "") for c in ("ops", "before", "after")))
    yield _arrow(out.report())


# --------------------------------------------------------------------------- learning and notifications

def learn_task(tasks: Iterator[dict], *, storage_options) -> Iterator[dict]:
    """Partial learning summaries per (dbid, collection) of the entity rows in each task's files
    ({"files"}): small, merged on the driver. The task reads its parquet itself, four columns of it."""
    from entity_assets.learning import Summary

    summaries: dict[tuple[str, str], Summary] = {}
    for task in tasks:
        for batch in _file_batches(task, storage_options, ["dbid", "collection", "after", "kind"]):
            entity = batch.filter(pc.equal(batch.column("kind"), "entity"))
            for dbid, collection, after in zip(*(entity.column(c).to_pylist() for c in ("dbid", "collection", "after"))):
                doc = core.loads(after)
                if isinstance(doc, dict):
                    summaries.setdefault((dbid, collection), Summary()).observe(doc)
    yield from ({"dbid": d, "collection": c, "summary": s.to_json()} for (d, c), s in summaries.items())


def over_files(tasks: Iterator[dict], *, body, storage_options, columns: list[str] | None = None,
               **kwargs) -> Iterator[dict]:
    """Runs `body` (input batches in, report batches out) over the rows of each task's files
    ({"files"}; `columns` of them, None: all), for `run_tasks`.

    The task reads its parquet files itself: no scan in Spark's JVM, no Arrow hand-over.
    """
    for task in tasks:
        for report in body(_file_batches(task, storage_options, columns), storage_options=storage_options, **kwargs):
            yield from to_rows(report)


def _file_batches(task: dict, storage_options, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The rows of a task's files ({"files"}), batch by batch."""
    return read_files(task["files"], storage_options, columns=columns)


def zone_changes_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options,
                      publishing: Publishing | None = None) -> Iterator[pa.RecordBatch]:
    """Writes the slice's entity updates to zone_changes, publishing each to its `subjectZone`.

    A subscription that moved from a zone (`leftZone`) is a row there too, right after its row
    in its new zone, so each partition has an entity's messages in order. Counts by zone
    (counters "subjectZone:<zone>"), of its `ZONES_COUNTED` busiest zones, and how many others
    it had ("zones_uncounted"): the driver gathers every task's counters.
    """
    out, zones = Outputs(slice_key, uris, storage_options, publishing), Counter()
    for batch in batches:
        rows = _with_left_zones(pa.Table.from_batches([batch]))  # the rows stay in Arrow
        zones.update({vc["values"]: vc["counts"] for vc in pc.value_counts(rows.column("subjectZone")).to_pylist()})
        out.emit_rows("zone_changes", rows)
    for zone, n in zones.most_common(ZONES_COUNTED):
        out.count(f"subjectZone:{zone}", n)
    if len(zones) > ZONES_COUNTED:
        out.count(ZONES_UNCOUNTED, len(zones) - ZONES_COUNTED)
    yield _arrow(out.report())


ZONES_COUNTED = 1_000
"""Zones a zone_changes task counts for the materialization (which shows the busiest): a slice of
a million zones (a zone per user) would hold each task's every zone in the driver."""
ZONES_UNCOUNTED = "zones_uncounted"


def _with_left_zones(rows: pa.Table) -> pa.Table:
    if "leftZone" not in rows.column_names or rows.column("leftZone").null_count == rows.num_rows:
        return rows  # no subscription moved (or files of a release before leftZone)
    at, field = rows.column_names.index("subjectZone"), rows.schema.field("subjectZone")
    pieces, start = [], 0
    for i in pc.indices_nonzero(pc.is_valid(rows.column("leftZone"))).to_pylist():  # slices: no copy of the documents
        left = rows.slice(i, 1)
        pieces += [rows.slice(start, i + 1 - start), left.set_column(at, field, left.column("leftZone"))]
        start = i + 1
    return pa.concat_tables([*pieces, rows.slice(start)])


_CHANGE_COLUMNS = ["kafka_topic", "kafka_partition", "kafka_offset", "kafka_timestamp", "dbid", "collection", "zone",
                   "entity", "action", "ended", "clientid", "request", "part", "begun"]
"""The columns a changes_by_device row takes from its zone change."""
FAN_OUT_COLUMNS = list(dict.fromkeys([*_CHANGE_COLUMNS, *notify.RECIPIENT_INPUTS]))
"""What `fan_out_task` reads of zone_changes: not the documents, the longest columns."""


def fan_out_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options,
                 subscriptions: notify.SubscriptionIndex,
                 publishing: Publishing | None = None) -> Iterator[pa.RecordBatch]:
    """Input: the slice's zone changes; subscriptions: those in effect.

    A change's rows are its columns, taken once per device to notify, with the device's own.
    """
    # a row group per device_inboxes bucket: each task of device_notifications reads its own (inbox_events)
    out = Outputs(slice_key, uris, storage_options, publishing, row_groups_by={"changes_by_device": "bucket"})
    types = SCHEMAS["changes_by_device"]

    def emit(changes: pa.Table, at: list[int], added: tuple[list, list, list]) -> None:
        rows = changes.take(pa.array(at, pa.int64()))
        for name, values in zip(("device", "user", "notification"), added):
            rows = rows.append_column(name, pa.array(values, types.field(name).type))
        rows = rows.append_column("bucket", pa.array([core.key_bucket(d) for d in added[0]], types.field("bucket").type))
        out.emit_rows("changes_by_device", rows.append_column("slice", pa.repeat(pa.scalar(slice_key), len(at))))

    for batch in batches:
        changes = pa.Table.from_batches([batch]).select(_CHANGE_COLUMNS)
        at, added = [], ([], [], [])
        for i, change in enumerate(zip(*(batch.column(name).to_pylist() for name in notify.RECIPIENT_INPUTS))):
            for recipient in notify.recipients(subscriptions, *change):
                at.append(i)
                for values, value in zip(added, recipient):
                    values.append(value)
            if len(at) >= FAN_OUT_ROWS:  # a busy zone's many devices: memory bounded whatever the fan-out
                emit(changes, at, added)
                at, added = [], ([], [], [])
        if at:
            emit(changes, at, added)
    yield _arrow(out.report())


FAN_OUT_ROWS = 200_000
"""Summaries a fan-out task holds before writing them: 20,000 changes in a zone 2,000 devices watch
are 40 million, about 20 GB as Python lists and Arrow rows."""


UNMATCHED = "unmatched_ack_ids"
"""inbox_task's counter of the ids acks named that were not pending: acknowledged before (an ack
delivered again), expired, or never sent to that device (an app's bug)."""
EXPIRED_NOTIFICATIONS = "expired_notifications"
"""inbox_task's counter of notifications that inboxes past notify.MAX_PENDING let go."""


def inbox_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options,
               state_files: dict[int, list[TableFile]], write_state: bool, state_file_rows: int = shards.FILE_ROWS,
               publishing: Publishing | None = None) -> Iterator[pa.RecordBatch]:
    """Input: notifications and acks of the slice, sorted by bucket and INBOX_ORDER.

    A device's acks apply before its new notifications (kind ACK < NOTIFY). The task also
    publishes the change summaries (changes-by-device), each device's in the order the fold
    applied their changes: the fan-out's tasks split a device's summaries by zone-changes file.
    """
    out = Outputs(slice_key, uris, storage_options, publishing)
    store = BucketStore(out.writer("device_inboxes"), ("device",), state_files, write_state, storage_options,
                        state_file_rows)
    batches = _published_as_read(out, batches, "changes_by_device", "kind", NOTIFY)  # not the acks
    for bucket, rows, keys in _buckets(batches, ("device",)):
        store.switch(bucket, keys)
        for device, events in groupby(rows, key=lambda r: r["device"]):
            events = list(events)
            stored = store.get((device,))
            inbox = (notify.DeviceInbox.from_json(stored["document"]) if stored
                     else notify.DeviceInbox(events[0]["dbid"], events[0]["user"], device))
            dirty = False
            for row in events:
                if row["kind"] == NOTIFY:
                    added = inbox.add(row["notification"], row["ended"])
                    dirty = added or dirty or (inbox.dbid, inbox.user) != (row["dbid"], row["user"])
                    inbox.dbid, inbox.user = row["dbid"], row["user"]  # whom the device was last notified for
                else:
                    ids = json.loads(row["notifications"]) if row["notifications"] else None
                    removed, missed = inbox.ack(ids, row["upTo"])
                    dirty = removed > 0 or dirty
                    if missed:
                        out.count(UNMATCHED, missed)
            expired = inbox.expire(notify.MAX_PENDING)
            if expired:
                out.count(EXPIRED_NOTIFICATIONS, expired)
                dirty = True
            if dirty:
                out.emit("device_notifications", {"slice": slice_key, **_message_row(inbox)})
                store.put((device,), {"slice": slice_key, "dbid": inbox.dbid, "user": inbox.user, "device": device,
                                      "version": 0, "deleted": False, "document": inbox.to_json(),
                                      "ended": inbox.ended, "bucket": bucket})
    out.close_state("device_inboxes", store)
    yield _arrow(out.report())


def _published_as_read(out: Outputs, batches: Iterator[pa.RecordBatch], table: str, column: str,
                       value: str) -> Iterator[pa.RecordBatch]:
    """A task's input batches, once the `table` messages of their rows whose `column` is `value`
    are spooled, in the input's order (when the task publishes `table`)."""
    if out.publisher is None or not out.publisher.publishes(table):
        yield from batches
        return
    for batch in batches:
        rows = pa.Table.from_batches([batch])
        out.publish_rows(table, rows.filter(pc.equal(rows.column(column), value)))
        yield batch


def devices_task(batches: Iterator[pa.RecordBatch], *, slice_key: str, uris: dict[str, str], storage_options,
                 state_files: dict[int, list[TableFile]], write_state: bool,
                 state_file_rows: int = shards.FILE_ROWS) -> Iterator[pa.RecordBatch]:
    """Input: the slice's connections, sorted by (bucket, dbid, user, device, begun).

    Counts the change of each app version's device count (counters "app_version:<version>"),
    so the driver keeps the counts without reading the state.
    """
    out = Outputs(slice_key, uris, storage_options)
    store = BucketStore(out.writer("devices"), notify.DEVICE_KEY, state_files, write_state, storage_options,
                        state_file_rows)
    for bucket, rows, keys in _buckets(batches, notify.DEVICE_KEY):
        store.switch(bucket, keys)
        for key, connections in groupby(rows, key=lambda c: tuple(c[k] for k in notify.DEVICE_KEY)):
            stored = device = store.get(key)
            for connection in connections:
                device = notify.seen(device, connection)
            store.put(key, {**device, "slice": slice_key, "bucket": bucket})
            if stored is None or stored["appVersion"] != device["appVersion"]:
                if stored is not None:
                    out.count(f"{APP_VERSION}{stored['appVersion']}", -1)
                out.count(f"{APP_VERSION}{device['appVersion']}")
    out.close_state("devices", store)
    yield _arrow(out.report())


def _message_row(inbox) -> dict:
    msg = inbox.message()
    return {k: msg[k] for k in ("dbid", "user", "device", "count", "begun", "ended")}
