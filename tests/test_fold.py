"""Bucketed folds whose tasks read their own input files (fold.over_buckets): pure Python."""

import json
import os
import pickle
import zlib

import pyarrow as pa
import pyarrow.parquet as pq

from entity_assets import core, fold, kafka_io, notify, publish
from entity_assets.publish import Publishing
from entity_assets.storage import from_rows
from entity_assets.tables import SCHEMAS


def test_key_buckets_are_the_crc32_of_the_joined_key_as_spark_computed_them():
    """State written by earlier releases was bucketed by Spark's crc32(concat_ws('\\x1f', key)) % 32,
    which skips null parts: the same rows must land in the same buckets."""
    data = pa.table({"dbid": ["db", "db", "db", None], "user": ["u1", "u2", "u1", "u3"], "device": ["d1", "d1", "d1", "d9"]})
    expected = [zlib.crc32(b"db\x1fu1\x1fd1") % 32, zlib.crc32(b"db\x1fu2\x1fd1") % 32,
                zlib.crc32(b"db\x1fu1\x1fd1") % 32, zlib.crc32(b"u3\x1fd9") % 32]
    assert fold.key_buckets(data, ("dbid", "user", "device")).to_pylist() == expected
    assert core.key_bucket("db\x1fu1\x1fd1") == expected[0]


def _write(path, rows, table):
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMAS[table]), path)
    return str(path)


def _connection(i: int, device: str, begun: int) -> dict:
    return {"slice": "0000000001", "kafka_topic": "connections", "kafka_partition": 0, "kafka_offset": i,
            "kafka_timestamp": begun, "clientid": "c", "dbid": "db", "user": f"u{i % 3}", "device": device,
            "appVersion": "1.0", "begun": begun}


def test_tasks_read_every_file_and_keep_their_buckets_sorted_by_the_fold_order(tmp_path):
    rows = [_connection(i, f"d{i % 7}", 1000 - i) for i in range(60)]
    sources = {"connections": [_write(tmp_path / "a.parquet", rows[:25], "connections"),
                               _write(tmp_path / "b.parquet", rows[25:], "connections")]}
    seen = []

    def body(batches, *, storage_options, tag):
        got = pa.Table.from_batches(list(batches)).to_pylist()
        seen.append((tag, got))
        yield pa.RecordBatch.from_pylist([{"table": "count:rows", "path": "", "size": 0, "rows": len(got), "stats": ""}],
                                         schema=fold.FILES_SCHEMA)

    order = ("dbid", "user", "device", "begun")
    tasks = [{"buckets": list(range(i, 32, 3))} for i in range(3)]
    reports = [r for task in tasks for r in fold.over_buckets(iter([task]), body=body, sources=sources,
                                                             reader=fold.connection_rows,
                                                             key_columns=("dbid", "user", "device"), order=order,
                                                             storage_options=None, tag=task["buckets"][0])]
    assert sum(r["rows"] for r in reports) == 60  # every row once
    for first, got in seen:
        assert {r["bucket"] for r in got} <= set(range(first, 32, 3))
        keys = [(r["bucket"],) + tuple(r[c] for c in order) for r in got]
        assert keys == sorted(keys)
        for r in got:
            assert r["bucket"] == core.key_bucket(f"{r['dbid']}\x1f{r['user']}\x1f{r['device']}")


def test_on_an_object_store_tasks_read_their_files_at_once_and_fold_the_same_rows(tmp_path, monkeypatch):
    import threading

    sources = {"connections": [_write(tmp_path / f"{i}.parquet", [_connection(i * 10 + j, f"d{j}", 1000 - j) for j in range(10)],
                                      "connections") for i in range(6)]}
    threads = set()

    def reader(*args):
        threads.add(threading.current_thread().name)
        return fold.connection_rows(*args)

    def folded() -> list:
        seen = []

        def body(batches, *, storage_options):
            seen.append(pa.Table.from_batches(list(batches)).to_pylist())
            return iter(())

        for task in ({"buckets": list(range(0, 32, 2))}, {"buckets": list(range(1, 32, 2))}):
            list(fold.over_buckets(iter([task]), body=body, sources=sources, reader=reader,
                                   key_columns=("dbid", "user", "device"), order=("dbid", "user", "device", "begun"),
                                   storage_options=None))
        return seen

    inline = folded()
    assert threads == {threading.current_thread().name}
    monkeypatch.setattr(fold, "files_ahead", lambda files: 8)  # what an object store's files get
    threads.clear()
    assert folded() == inline and sum(map(len, inline)) == 60
    assert threads and all(name.startswith("lake-io") for name in threads)


def test_inbox_events_put_notifications_and_acks_in_one_layout(tmp_path):
    note = {"slice": "0000000001", "kafka_topic": "entity-updates", "kafka_partition": 0, "kafka_offset": 1,
            "kafka_timestamp": 5, "dbid": "db", "collection": "Contacts", "zone": "A", "entity": "e1",
            "notification": "n1", "action": "created", "ended": 5, "device": "d1", "user": "u1",
            "bucket": core.key_bucket("d1"), "clientid": "c", "request": 3, "part": 1, "begun": 4}
    ack = {"slice": "0000000001", "kafka_topic": "notification-acks", "kafka_partition": 0, "kafka_offset": 2,
           "kafka_timestamp": 7, "dbid": "db", "user": "u1", "device": "d1", "notifications": '["n1"]', "upTo": None,
           "begun": 7}
    notes = fold.inbox_events("changes_by_device", _write(tmp_path / "n.parquet", [note], "changes_by_device"), None,
                              [note["bucket"]])
    acks = fold.inbox_events("notification_acks", _write(tmp_path / "a.parquet", [ack], "notification_acks"), None, [])
    assert notes.schema == acks.schema == fold.INBOX_EVENTS
    assert notes.to_pylist() == [{"dbid": "db", "user": "u1", "device": "d1", "kind": fold.NOTIFY, "notification": "n1",
                                  "ended": 5, "notifications": None, "upTo": None, "collection": "Contacts",
                                  "zone": "A", "entity": "e1", "action": "created",  # what its message says
                                  "begun": 4, "clientid": "c", "request": 3, "part": 1}]  # the fold's order
    assert acks.to_pylist() == [{"dbid": "db", "user": "u1", "device": "d1", "kind": fold.ACK, "notification": None,
                                 "ended": 7, "notifications": '["n1"]', "upTo": None, "collection": None,
                                 "zone": None, "entity": None, "action": None, "begun": None, "clientid": None,
                                 "request": None, "part": None}]


def test_inbox_events_read_changes_by_device_files_of_an_older_lake(tmp_path):
    """Files written before changes_by_device had the request columns (added in place) read as
    nulls there: the inbox fold of an old slice orders them by `ended`, then notification id."""
    older = pa.schema([f for f in SCHEMAS["changes_by_device"] if f.name not in core.ORDER])
    row = {"slice": "0000000001", "dbid": "db", "device": "d1", "user": "u1", "notification": "n1", "ended": 5,
           "bucket": core.key_bucket("d1")}
    pq.write_table(pa.Table.from_pylist([row], schema=older), tmp_path / "old.parquet")
    [event] = fold.inbox_events("changes_by_device", str(tmp_path / "old.parquet"), None, [row["bucket"]]).to_pylist()
    assert (event["notification"], event["ended"]) == ("n1", 5)
    assert [event[c] for c in core.ORDER] == [None] * len(core.ORDER)


def test_multipart_parts_skip_single_part_results(tmp_path):
    def result(part, parts):
        return {"clientid": "c", "request": 1, "user": "u", "dbid": "db", "parts": parts, "part": part, "status": 1,
                "stream": "entity-updates"}

    uri = _write(tmp_path / "p.parquet", [result(1, 1), result(1, 2), result(2, 2)], "partial_responses")
    assert [(r["part"], r["parts"]) for r in fold.multipart_parts("partial_responses", uri, None, []).to_pylist()] == [(1, 2), (2, 2)]
    assert fold.multipart_parts("pending_responses", uri, None, []).num_rows == 3


def test_each_inbox_task_decodes_only_its_buckets_of_the_notifications(tmp_path):
    """changes_by_device files hold a row group per device_inboxes bucket, so the tasks of
    device_notifications together read the slice's notifications once."""
    devices = [f"device{i}" for i in range(40)]
    subscriptions = [("db", "subs", f"sub{i}", notify.parse_subscription({"subjectZone": "A", "device": d, "user": "u1"}))
                     for i, d in enumerate(devices)]
    change = {"slice": "0000000001", "kafka_topic": "entity-updates", "kafka_partition": 0, "kafka_offset": 3,
              "kafka_timestamp": 9, "clientid": "c", "request": 1, "part": 1, "dbid": "db", "collection": "Contacts",
              "zone": "A", "entity": "e1", "status": 1, "action": "created", "ended": 9, "begun": 8}
    uri = str(tmp_path / "changes_by_device")
    (tmp_path / "changes_by_device").mkdir()
    [report] = fold.fan_out_task(iter([pa.RecordBatch.from_pylist([change])]), slice_key="0000000001",
                                 uris={"changes_by_device": uri}, storage_options=None,
                                 subscriptions=notify.SubscriptionIndex(subscriptions))
    [written] = [r for r in report.to_pylist() if r["table"] == "changes_by_device"]
    path = f"{uri}/{written['path']}"
    rows = pq.read_table(path).to_pylist()
    assert sorted(r["device"] for r in rows) == sorted(devices)
    for row in rows:  # the change's fields, the device's own, its bucket
        assert {k: row[k] for k in fold._CHANGE_COLUMNS} == {k: change[k] for k in fold._CHANGE_COLUMNS}
        assert row["user"] == "u1" and row["slice"] == "0000000001" and row["bucket"] == core.key_bucket(row["device"])
        assert row["notification"] == notify.notification_id(row["device"], "db", "Contacts", "A", "e1", "c", 1, 1)
    metadata = pq.ParquetFile(path).metadata
    buckets = sorted({core.key_bucket(d) for d in devices})
    assert metadata.num_row_groups == len(buckets)  # one per bucket
    for group in range(metadata.num_row_groups):
        stats = metadata.row_group(group).column(SCHEMAS["changes_by_device"].get_field_index("bucket")).statistics
        assert stats.min == stats.max

    mine = buckets[::3]
    events = fold.inbox_events("changes_by_device", path, None, mine)
    assert sorted(events.column("device").to_pylist()) == sorted(d for d in devices if core.key_bucket(d) in mine)


def test_a_device_whose_inbox_gets_only_ids_it_holds_gets_no_message(tmp_path):
    """A change whose request id comes again (past the dedupe window) notifies the ids it did: the
    inbox holds them, so nothing changed and device-notifications says nothing (it repeated the
    device's count, as if a notification had come)."""
    from entity_assets.storage import TableFile

    uris = {t: str(tmp_path / t) for t in ("changes_by_device", "device_notifications", "device_inboxes")}
    for uri in uris.values():
        os.makedirs(uri)
    subscriptions = notify.SubscriptionIndex([("db", "subs", "s1", notify.parse_subscription(
        {"subjectZone": "A", "device": "d1", "user": "u1"}))])
    change = {"kafka_topic": "t", "kafka_partition": 0, "kafka_offset": 1, "kafka_timestamp": 1001, "dbid": "db",
              "collection": "Contacts", "zone": "A", "entity": "e1", "action": "created", "ended": 1001,
              "clientid": "c", "request": 1, "part": 1, "begun": 1001, "status": 1}
    schema = pa.schema([(c, SCHEMAS["zone_changes"].field(c).type) for c in fold.FAN_OUT_COLUMNS])

    def run(key: str, state: dict) -> list[dict]:
        report = [r for b in fold.fan_out_task(iter([pa.RecordBatch.from_pylist([change], schema=schema)]), slice_key=key,
                                               uris=uris, storage_options=None, subscriptions=subscriptions)
                  for r in b.to_pylist()]
        notes = [TableFile(r["path"], f"{uris['changes_by_device']}/{r['path']}", r["size"], r["rows"])
                 for r in report if r["table"] == "changes_by_device"]
        return list(fold.over_buckets(iter([{"buckets": list(range(32))}]), body=fold.inbox_task,
                                      sources={"changes_by_device": notes, "notification_acks": []},
                                      reader=fold.inbox_events, key_columns=("device",), order=fold.INBOX_ORDER,
                                      storage_options=None, slice_key=key, uris=uris, state_files=state,
                                      write_state=True))

    def rows(report: list[dict], table: str) -> list[dict]:
        return [row for r in report if r["table"] == table for row in pq.read_table(f"{uris[table]}/{r['path']}").to_pylist()]

    first = run("0000000001", {})
    assert [(m["device"], m["count"]) for m in rows(first, "device_notifications")] == [("d1", 1)]
    state = {}
    for r in first:
        if r["table"] == "device_inboxes":
            stats = json.loads(r["stats"])
            state.setdefault(stats["minValues"]["bucket"], []).append(TableFile(
                r["path"], f"{uris['device_inboxes']}/{r['path']}", r["size"], r["rows"], stats["minValues"],
                stats["maxValues"]))
    assert rows(run("0000000002", state), "device_notifications") == []


def test_a_fan_out_writes_its_summaries_as_they_add_up_in_the_order_it_made_them(tmp_path, monkeypatch):
    """20,000 changes in a zone 2,000 devices watch are 40 million summaries: a task holds at most
    `FAN_OUT_ROWS` of them (past one change's) before they go to its writer."""
    devices = [f"device{i}" for i in range(7)]
    subscriptions = [("db", "subs", f"sub{i}", notify.parse_subscription({"subjectZone": "A", "device": d, "user": "u1"}))
                     for i, d in enumerate(devices)]
    changes = [{"slice": "0000000001", "kafka_topic": "entity-updates", "kafka_partition": 0, "kafka_offset": n,
                "kafka_timestamp": 9, "clientid": "c", "request": n, "part": 1, "dbid": "db", "collection": "Contacts",
                "zone": "A", "entity": f"e{n}", "status": 1, "action": "updated", "ended": 9, "begun": 8} for n in range(10)]
    written = []
    monkeypatch.setattr(fold.Outputs, "emit_rows", lambda self, table, rows, texts=None: written.append(rows))

    def fan_out(rows: int) -> pa.Table:
        monkeypatch.setattr(fold, "FAN_OUT_ROWS", rows)
        written.clear()
        list(fold.fan_out_task(iter([pa.RecordBatch.from_pylist(changes)]), slice_key="0000000001",
                               uris={"changes_by_device": str(tmp_path)}, storage_options=None,
                               subscriptions=notify.SubscriptionIndex(subscriptions)))
        return list(written)

    whole, cut = fan_out(10**6), fan_out(15)
    assert len(whole) == 1 and [t.num_rows for t in cut] == [21, 21, 21, 7]  # whole changes, 7 devices each
    assert pa.concat_tables(cut) == whole[0]


def test_respond_fills_updates_partial_and_complete_responses(tmp_path, monkeypatch):
    """Status 1 results are updates, every result is a partial response, a single-part
    request's result is its complete response at once (responses: its one text), and a learned
    one is a schema-learning row with its document as `after`, across batches; their messages
    are the per-row encoders'."""
    monkeypatch.setattr(fold, "BATCH_ROWS", 2)
    tables = ("entity_updates", "partial_responses", "complete_responses", "schema_learning")
    uris = {t: str(tmp_path / t) for t in tables}
    for t in tables:
        (tmp_path / t).mkdir()
    (tmp_path / "outbox").mkdir()
    topics = {t: (t.replace("_", "-"), 3) for t in tables}
    out = fold.Outputs("0000000001", uris, None, Publishing({}, topics, str(tmp_path / "outbox")), updates="entity_updates")

    def result(request, part, parts, status):
        return {"slice": "0000000001", "kafka_topic": "entity-batches", "kafka_partition": 0, "kafka_offset": request,
                "kafka_timestamp": 5, "clientid": "c", "request": request, "user": "u", "dbid": "db",
                "collection": "Contacts", "zone": "A", "entity": "e1", "parts": parts, "part": part, "begun": 4,
                "ops": "[]", "learning": False, "includeBefore": False, "includeAfter": False, "ended": 5 + request,
                "status": status, "error": None if status == 1 else "boom", "before": None, "after": None,
                "action": "updated" if status == 1 else None, "subjectZone": "A", "stream": "entity-updates",
                "bucket": 7, "previousSlice": None, "leftZone": None}

    results = [result(1, 1, 1, 1), result(2, 1, 1, 3), result(3, 1, 2, 1), result(3, 2, 2, 1), result(4, 1, 1, 1)]
    learned = {1: '{"name":"learned"}', 3: '{"name":"three"}'}  # by request: their schema-learning after
    # the fold's results: its patch columns (the entity's bucket among them) and those it adds
    struct = pa.struct(list(SCHEMAS["partial_responses"]) + [SCHEMAS["entity_updates"].field(c)
                                                             for c in ("bucket", "previousSlice", "leftZone")])
    for chunk in (results[:2], results[2:4], results[4:]):
        out.respond_rows(pa.Table.from_batches([from_rows(chunk, struct)]),
                         pa.array([learned.get(r["request"]) for r in chunk], pa.string()))
    written, report = {t: [] for t in tables}, out.report()
    for f in report:
        if f["table"] in written:
            written[f["table"]] += pq.read_table(f"{uris[f['table']]}/{f['path']}").to_pylist()

    assert sorted((r["request"], r["part"]) for r in written["partial_responses"]) == [(1, 1), (2, 1), (3, 1), (3, 2), (4, 1)]
    assert sorted((r["request"], r["part"]) for r in written["entity_updates"]) == [(1, 1), (3, 1), (3, 2), (4, 1)]
    complete = sorted(written["complete_responses"], key=lambda r: r["request"])
    assert [r["request"] for r in complete] == [1, 2, 4]
    for row in complete:
        [single] = [r for r in results if r["request"] == row["request"]]
        assert row == core.complete_row([single], "0000000001")
    assert out.counts == {"status:entity-updates:1": 4, "status:entity-updates:3": 1, "multipart": 2}
    assert sorted((r["request"], r["part"], r["after"], r["kind"]) for r in written["schema_learning"]) == [
        (1, 1, learned[1], "entity"), (3, 1, learned[3], "entity"), (3, 2, learned[3], "entity")]

    # the messages made a batch at a time are the per-row encoders' (key, text, partition)
    [spool] = [f for f in report if f["table"] == publish.OUTBOX]
    names = [t for t, _ in topics.values()]
    with open(spool["path"], "rb") as source:
        sent = sorted((names[t], key.decode(), value.decode(), p) for batch in kafka_io.spooled(source)
                      for t, p, key, value in zip(*(c.to_pylist() for c in batch.columns)))
    expected = []
    for table, rows in written.items():
        stream = publish.STREAMS[table]
        for row in rows:
            if table == "partial_responses" and row["parts"] > 1:
                continue  # complete_task publishes them, a request's in part order
            partition = publish.partition_for(row[stream.partition_by], 3) if stream.partition_by else -1
            expected.append((topics[table][0], stream.key(row), stream.encode(row), partition))
    assert sent == sorted(expected)


def test_a_released_task_yields_every_output_of_its_body_in_order_and_finishes_it():
    finished = []

    def body(tasks):
        for task in tasks:
            yield {"table": task, "rows": 1}
        finished.append(True)

    assert list(fold.released(body, iter(["a", "b"]))) == [{"table": "a", "rows": 1}, {"table": "b", "rows": 1}]
    assert finished == [True]


def test_tasks_in_the_step_s_process_hold_their_spools_in_memory_and_tasks_elsewhere_write_files(tmp_path):
    rows = pa.table({"dbid": ["db", "db"], "device": ["d1", "d2"], "collection": ["C", "C"], "zone": ["A", "A"],
                     "entity": ["e1", "e1"], "notification": ["n1", "n2"], "action": ["created", "created"],
                     "ended": [5, 5]})
    topics = {"changes_by_device": ("changes-by-device", 2)}
    here = Publishing({}, topics, str(tmp_path), held_by=publish.process())  # as the step makes it
    host, _, pid = publish.process().rpartition(":")
    elsewhere = Publishing({}, topics, str(tmp_path), held_by=f"{host}-other:{pid}")  # a worker of another host
    spools = {}
    for name, publishing in (("here", here), ("elsewhere", elsewhere)):
        publisher = publish.Publisher(publishing)
        publisher.send_rows("changes_by_device", rows)
        spools[name] = publisher.close()
    assert list(here.held) == [spools["here"]["path"]] and not elsewhere.held
    assert os.listdir(tmp_path) == [os.path.basename(spools["elsewhere"]["path"])]
    with open(spools["elsewhere"]["path"], "rb") as source:
        assert list(kafka_io.spooled(pa.BufferReader(here.held[spools["here"]["path"]]))) == list(
            kafka_io.spooled(source))
    assert pickle.loads(pickle.dumps(here)).held == {}  # shipped to tasks without them


def test_a_batch_of_results_is_cut_where_its_documents_would_outgrow_a_column_of_text(monkeypatch):
    """Documents asked for (`includeAfter`, learning) are cut into batches of at most
    `RESULT_TEXT_BYTES`: the same results, in the same order, as one batch gives."""
    class Store:
        def __init__(self):
            self.rows = {}

        def get(self, key):
            return None

        def put(self, key, row):
            self.rows[key] = row

    class Out:
        def __init__(self):
            self.published, self.results = [], []

        def publish_rows(self, table, rows):
            self.published.append(rows)

        def respond_rows(self, rows, learned):
            self.results.append((rows, learned))

    patches = pa.Table.from_batches([from_rows([
        {"slice": "0000000001", "kafka_topic": "entity-batches", "kafka_partition": 0, "kafka_offset": n,
         "kafka_timestamp": 5, "clientid": "c", "request": n, "user": "u", "dbid": "db", "collection": "C",
         "zone": "A", "entity": "e" if n < 5 else "f", "parts": 1, "part": 1, "begun": n,
         "ops": json.dumps([{"op": "add", "path": f"/f{n}", "value": "x" * 100}]), "learning": n % 2 == 0,
         "includeBefore": False, "includeAfter": n != 3, "bucket": 1} for n in range(8)],
        pa.struct(list(SCHEMAS["entity_patches"])))])

    def fold_with(limit):
        monkeypatch.setattr(fold, "RESULT_TEXT_BYTES", limit)
        out, store = Out(), Store()
        fold._fold_bucket(out, store, patches, 1, "0000000001")
        return out, store

    whole, whole_store = fold_with(2**40)
    cut, cut_store = fold_with(500)
    assert len(whole.results) == 1 and len(cut.results) > 2
    assert pa.concat_tables([r for r, _ in cut.results]) == whole.results[0][0]
    assert pa.concat_arrays([learned for _, learned in cut.results]) == whole.results[0][1]
    assert pa.concat_tables(cut.published) == pa.concat_tables(whole.published)
    assert cut_store.rows == whole_store.rows and len(cut_store.rows) == 2


def test_a_large_task_s_rows_are_sorted_a_batch_at_a_time_in_the_order_a_whole_sort_gives(monkeypatch):
    """Sorted whole, a column of text past 2 GiB (a task's multi-part requests with their documents)
    would not fit one Arrow array: a large task's batches are taken from the chunks that hold them."""
    import random

    rng = random.Random(3)
    schema = pa.schema([("bucket", pa.int32()), ("clientid", pa.string()), ("request", pa.int64()), ("after", pa.string())])
    parts = [pa.table({"bucket": [rng.randrange(4) for _ in range(n)],
                       "clientid": [rng.choice(["a", "b", None]) for _ in range(n)],
                       "request": [rng.randrange(50) for _ in range(n)], "after": [f"doc{i}" for i in range(n)]},
                      schema=schema)
             for n in (7, 300, 0, 41, 1000)]
    rows = pa.concat_tables(parts)
    sort = [(c, "ascending", "at_start") for c in ("bucket", "clientid", "request")]
    whole = list(fold.sorted_batches(rows, sort, size=64))
    monkeypatch.setattr(fold, "SORT_WHOLE_BYTES", 0)
    cut = list(fold.sorted_batches(rows, sort, size=64))
    assert max(b.num_rows for b in cut) <= 64 and len(cut) > 5
    assert pa.Table.from_batches(cut).to_pylist() == pa.Table.from_batches(whole).to_pylist()
    # and by bytes: 20,000 rows of 110 KB would pass 2 GiB in one batch
    monkeypatch.setattr(fold, "SORTED_BATCH_BYTES", 700)
    small = list(fold.sorted_batches(rows, sort, size=64))
    assert max(b.num_rows for b in small) <= 700 // 64 and len(small) > len(cut)
    assert pa.Table.from_batches(small).to_pylist() == pa.Table.from_batches(whole).to_pylist()
    assert [r["after"] for r in pa.Table.from_batches(cut).to_pylist()] != rows.column("after").to_pylist()


def test_complete_responses_are_converted_before_their_text_outgrows_a_column(tmp_path, monkeypatch):
    """20,000 complete responses of multi-part requests with their documents could pass 2 GiB in
    one conversion to Arrow: published ones are held up to `RESULT_TEXT_BYTES` of their text."""
    converted = []
    real = fold.from_rows
    monkeypatch.setattr(fold, "from_rows", lambda rows, struct: converted.append(len(rows)) or real(rows, struct))
    monkeypatch.setattr(fold, "RESULT_TEXT_BYTES", 1000)

    class Publisher:
        def publishes(self, table):
            return True

        def send_rows(self, table, rows, texts=None):
            pass

    out = fold.Outputs("0000000001", {"complete_responses": str(tmp_path)}, None)
    out.publisher = Publisher()
    row = {"slice": "0000000001", "clientid": "c", "request": 1, "user": "u", "dbid": "db", "parts": 2,
           "begun": 1, "ended": 2, "responses": "x" * 300}
    for request in range(10):
        out.emit("complete_responses", {**row, "request": request}, len(row["responses"]))
    out.flush_held()
    assert converted == [4, 4, 2]


def test_the_schema_fold_applies_each_database_s_patches_to_its_own_schema_within_a_bucket(tmp_path):
    """db-a and db-18 share bucket 7: a patch of the second must not apply to the first's schema."""
    assert core.key_bucket("db-a") == core.key_bucket("db-18") == 7
    tables = ("schema_updates", "partial_responses", "complete_responses", "schema_learning", "schemas")
    uris = {t: str(tmp_path / t) for t in tables}
    for t in tables:
        (tmp_path / t).mkdir()

    def patch(i, dbid, entity_type):
        return {"slice": "0000000001", "kafka_topic": "schema-patches", "kafka_partition": 0, "kafka_offset": i,
                "kafka_timestamp": 5, "clientid": "c", "request": i, "user": "u", "dbid": dbid, "parts": 1, "part": 1,
                "begun": 4, "ops": json.dumps([{"op": "add", "path": entity_type, "value": {"fields": {
                    "name": {"type": "STRING", "optional": False}}}}]),
                "includeBefore": True, "includeAfter": True, "bucket": 7}

    failing = {**patch(4, "db-18", "Groups"), "ops": json.dumps([{"op": "remove", "path": "Missing"}])}
    # in (bucket, dbid) order, as the task's input is
    rows = [patch(1, "db-18", "Groups"), failing, patch(2, "db-a", "Contacts"), patch(3, "db-a", "Orders")]
    schema = SCHEMAS["schema_patches"].append(pa.field("bucket", pa.int32()))
    report = list(fold.schema_fold_task(iter(pa.Table.from_pylist(rows, schema=schema).to_batches()),
                                        slice_key="0000000001", uris=uris, storage_options=None, state_files={},
                                        write_state=True))
    written = {t: [] for t in tables}
    for f in pa.Table.from_batches(report).to_pylist():
        if f["table"] in written:
            written[f["table"]] += pq.read_table(f"{uris[f['table']]}/{f['path']}").to_pylist()
    updates = {r["request"]: r for r in written["schema_updates"]}
    assert (updates[1]["before"], sorted(json.loads(updates[1]["after"]))) == (None, ["Groups"])  # a new database
    assert (updates[2]["before"], sorted(json.loads(updates[2]["after"]))) == (None, ["Contacts"])
    assert sorted(json.loads(updates[3]["after"])) == ["Contacts", "Orders"]
    # schema-updates holds every schema patch, a failed one with its status and error (the seed)
    assert updates[4]["status"] == 3 and updates[4]["error"] and updates[4]["after"] is None
    assert {r["dbid"]: sorted(json.loads(r["document"])) for r in written["schemas"]} == {
        "db-18": ["Groups"], "db-a": ["Contacts", "Orders"]}
