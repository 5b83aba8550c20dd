"""Input streams: Kafka records of a slice become the raw tables and dead letters."""


import json
from collections import Counter
from dataclasses import replace
from functools import partial

import pyarrow.compute as pc
from dagster import (AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, AssetExecutionContext, AssetSpec, Failure,
                     MaterializeResult, MetadataValue, multi_asset)

from entity_assets import qlik
from entity_assets.assets.common import (KINDS, RECENT_COMMITS, OutOfOrder, commit_slice, ensure_tables, file_tasks,
                                         pop_counts, run_tasks, slice_of, table_metadata, task_slots)
from entity_assets.assets import topics
from entity_assets.assets.retries import retried_when_transient
from entity_assets.ingest import (HELD, INPUT_STREAMS, STAMPS_MODULUS, IngestionStream, WaitHistory, ingest_tasks,
                                  lake_table, new_registrations, registry_before, resolve_tasks, waits_ending,
                                  waits_for)
from entity_assets.kafka_io import KafkaUnreachable, read_range, warm_producer, watermarks
from entity_assets.manifests import ManifestStore
from entity_assets.messages import DeadLetterCode
from entity_assets.partitions import LAKE_POOL, slices_partitions
from entity_assets.slices import slice_key as key_of, slice_seq, split_ranges
from entity_assets.storage import filesystem, read_table, read_tables
from entity_assets.tables import INPUT_TABLES
from resources import KafkaResource, LakeResource, SlicingResource, SparkResource

DESCRIPTIONS = {
    "entity_batches": "Batch requests from the entity-batches topic, validated; the durable log every derived stream is rebuilt from.",
    "schema_patches": "Schema patch requests from the schema-patches topic, validated.",
    "connections": "Driver connections (user, device, app version) from the connections topic, validated.",
    "notification_acks": "Acknowledgements of device notifications from the notification-acks topic, validated.",
    "avro_schemas": "Data schemas that Qlik Replicate metadata messages registered on the ingestion topics, by schema id: "
                    "the registry that their data messages are decoded with.",
    "dead_letters": "Every record that could not be parsed or validated, with its bytes, Kafka coordinates, code and reason.",
    "schema_waits": "Qlik data messages read before the metadata message of their schema: applied in the slice that "
                    "registers it; after the slicing resource's schema_wait_slices slices, also a dead letter.",
}
TABLES = tuple(s.table for s in INPUT_STREAMS.values()) + ("avro_schemas", "dead_letters", "schema_waits")
LETTER_TABLES = {s.name: s.table for s in INPUT_STREAMS.values()} | {IngestionStream.name: IngestionStream.table}
"""A dead letter's stream -> the table its record was read for: a CDC record's is entity_batches."""


def _firsts(kafka: KafkaResource, ranges, slicing: SlicingResource) -> dict[tuple[str, int], int]:
    """The first offsets Kafka holds of the partitions whose ranges take several tasks: a span gone
    (a stop past the retention) is one task, not one per `max_messages_per_task` offsets that are
    not there. Asked only then, and none if Kafka does not answer (the tasks find the span gone)."""
    split = sorted({r.topic for r in ranges if r.count > slicing.max_messages_per_task})
    if not split:
        return {}
    try:
        return {tp: low for tp, (low, _) in watermarks(kafka.config(), split, 5.0, []).items()}
    except KafkaUnreachable:
        return {}


@multi_asset(
    name="ingest",
    specs=[
        AssetSpec(t, deps=topics.read_from(t), description=DESCRIPTIONS[t], group_name="ingest",
                  kinds=KINDS)
        for t in TABLES
    ],
    check_specs=[AssetCheckSpec("no_dead_letters", asset="dead_letters",
                                description="every record of the slice parsed and validated; a warning counts "
                                            "the others by stream and code (their bytes and reasons are rows of the table)")],
    partitions_def=slices_partitions, pool=LAKE_POOL,
    can_subset=False,
)
@retried_when_transient
def ingest(context: AssetExecutionContext, spark: SparkResource, kafka: KafkaResource,
           lake: LakeResource, slicing: SlicingResource):
    """Reads exactly the manifest's offset ranges, so any re-run re-reads the same records."""
    engine = lake.open(snapshot=True)
    if kafka.publish:  # the later steps publish from this process: their producer starts now
        warm_producer(kafka.config())
    manifest = ManifestStore(engine).get(slice_of(context))
    ensure_tables(engine, manifest.key, TABLES)
    streams_by_topic = {r.topic: kafka.input_stream(r.topic) for r in manifest.ranges if r.count > 0}
    if unread := sorted(t for t, s in streams_by_topic.items() if s is None):
        raise Failure(f"slice {manifest.key} holds records of {', '.join(unread)}, which no input stream reads "
                      "(the seed's topics under the topic prefix, and the ingestion topics of the configured "
                      "sources): restore the Kafka resource's settings that closed the slice")
    ranges = [r for r in manifest.ranges if r.count > 0]
    registry = _registry(engine, manifest.key, streams_by_topic)
    highest = _highest_ingested(engine)
    endings = waits_ending(manifest.key, _wait_history(context, engine, slicing, manifest.key, highest))
    due = _due_waits(engine, kafka, manifest.key, endings)
    decoding = _schemas_first(kafka, ranges, streams_by_topic, registry) if registry is not None else {}
    streams_by_topic = {t: replace(s, registry=decoding) if isinstance(s, IngestionStream) else s
                        for t, s in streams_by_topic.items()}
    tasks = [vars(r) for r in split_ranges(ranges, slicing.max_messages_per_task, _firsts(kafka, ranges, slicing))]
    fn = partial(
        ingest_tasks, kafka_config=kafka.config(), streams_by_topic=streams_by_topic,
        slice_key=manifest.key, table_uris={t: engine.uri(t) for t in TABLES},
        storage_options=engine.storage_options,
    )
    files = run_tasks(spark, tasks, fn, manifest.messages)
    counts = pop_counts(files)
    stamps = str(counts["stamps"] % STAMPS_MODULUS)
    changed = _changed_since(engine, manifest.key, counts["read"], stamps, highest)
    highest = max(highest, manifest.key)
    if (counts["expired"] or changed) and (kept := _committed(engine, manifest.key)):
        yield from _keep(context, engine, manifest.key, files, kept, changed, highest)
        return
    resolved = _apply_waiting(spark, kafka, engine, files, registry, manifest.key, slicing, endings, due)
    if resolved:
        context.log.info(f"slice {manifest.key}: {resolved} data message(s) waiting for their schema applied")
    summary = commit_slice(engine, TABLES, files, manifest.key,
                           metadata={READ: str(counts["read"]), STAMPS: stamps, HIGHEST: highest})
    context.log.info(f"slice {manifest.key}: {manifest.messages} records in {len(tasks)} tasks -> "
                     + ", ".join(f"{t}={s['rows']}" for t, s in summary.items()))
    offsets: dict[str, dict[str, str]] = {}
    for r in ranges:
        table = streams_by_topic[r.topic].table
        offsets.setdefault(table, {})[f"{r.topic}[{r.partition}]"] = f"[{r.start}, {r.end})"
    letters = _letters(engine, manifest.key, summary["dead_letters"]["rows"])
    for table in TABLES:
        meta = table_metadata(engine, table, summary[table])
        if table == "entity_batches":
            meta["schema_pending_applied"] = MetadataValue.int(resolved)
        if table in INPUT_TABLES:  # its own records' dead letters (CDC records' are entity_batches')
            meta["dead_letters"] = MetadataValue.int(sum(n for (stream, _), n in letters.items()
                                                         if LETTER_TABLES.get(stream) == table))
            meta["offsets"] = MetadataValue.json(offsets.get(table, {}))
        meta["slice_messages"] = MetadataValue.int(manifest.messages)
        yield MaterializeResult(asset_key=table, metadata=meta)
    yield _dead_letters_check(letters)


def _registry(engine, slice_key: str, streams: dict) -> dict | None:
    """The Qlik schemas registered before the slice, if any of its topics may hold envelopes (None
    if none may)."""
    if not any(s.may_hold_envelopes for s in streams.values()):
        return None
    return _registry_before(engine, slice_key)


def _registry_before(engine, slice_key: str) -> dict:
    """The Qlik schemas registered before the slice. The slice before must be ingested: its
    metadata messages, and its data messages still waiting for theirs, are read from the lake."""
    seq = slice_seq(slice_key)
    if seq > 1 and not engine.reached("entity_batches", key_of(seq - 1), "replace_slice"):
        raise OutOfOrder(f"slice {slice_key} reads the Qlik schemas that the slices before it registered (to decode "
                         f"its ingestion topics' data messages, or to end their waits) and slice {key_of(seq - 1)} "
                         "is not ingested: materialize the slices in order")
    return registry_before(engine, slice_key)


def _schemas_first(kafka: KafkaResource, ranges: list, streams_by_topic: dict, registry: dict) -> dict:
    """The schemas the tasks decode with: those of the slices before (which win: an id names one
    schema) and those that the slice's records on schema topics register, read here first (a few
    metadata messages), so that data messages decode at once in the slice that registers their schema."""
    found: dict = {}
    decoder = qlik.Decoder({})
    for r in ranges:
        stream = streams_by_topic[r.topic]
        if not (stream.may_hold_envelopes and stream.projection == stream.source.schema_projection):
            continue
        for msg in read_range(kafka.config(), r, expired=lambda gone: None):
            try:
                registered = decoder.decode(msg.value())
            except Exception:  # the tasks read it too: it becomes a dead letter there
                continue
            if isinstance(registered, qlik.Registered):
                found.setdefault(registered.schema_id, registered)
    return {**found, **registry}


WAITS_NOTE = "schema-wait-slices"
"""The lake's note of its `WaitHistory`."""


def _wait_history(context, engine, slicing: SlicingResource, slice_key: str, highest: str) -> WaitHistory:
    """The `schema_wait_slices` each slice was first ingested with, a new setting from the first
    slice ingested after it changed: a re-run ends the waits its first run ended, and a change
    neither leaves a slice's waits unended nor ends them twice. A lake without the note (of a
    release before it) took the setting of now for all its slices."""
    noted = engine.read_note(WAITS_NOTE)
    history: WaitHistory = [tuple(pair) for pair in json.loads(noted)] if noted else []
    wait, seq = slicing.schema_wait_slices, slice_seq(slice_key)
    if history and (history[-1][1] == wait or seq <= slice_seq(highest or key_of(0))):
        return history  # a slice ingested before (a re-run, a backfill): its time's setting
    if history and history[-1][1] != wait:
        context.log.info(f"schema_wait_slices is {wait} from slice {slice_key} on ({history[-1][1]} before): the "
                         "slices whose waits end in a slice are found by the setting of its first run")
    history = [*(pair for pair in history if pair[0] < seq), (seq if history else 1, wait)]
    engine.write_note(WAITS_NOTE, json.dumps(history))
    return history


def _due_waits(engine, kafka: KafkaResource, slice_key: str, endings: list[str]) -> list:
    """The `schema_waits` files of the slices whose waits this one ends. Those must be ingested
    first if they may hold Qlik data messages: ingested after, their waits would never end."""
    due = []
    for ending in endings:
        if ending == slice_key:  # with no wait, this one: its committed files are a run's it replaces
            continue
        files = engine.slice_files("schema_waits", [ending])
        if not files and not engine.reached("entity_batches", ending, "replace_slice"):
            streams = (kafka.input_stream(r.topic) for r in ManifestStore(engine).get(ending).ranges if r.count > 0)
            if any(s is not None and s.may_hold_envelopes for s in streams):
                raise OutOfOrder(f"slice {slice_key} ends the waits for their schema of slice {ending}'s Qlik data "
                                 f"messages and slice {ending} is not ingested: materialize the slices in order")
        due.extend(files)
    return due


def _apply_waiting(spark, kafka: KafkaResource, engine, files: dict, registry: dict | None, slice_key: str,
                   slicing: SlicingResource, endings: list[str], due: list) -> int:
    """Qlik data messages waiting for their schema: applied in the slice that registers it, dead
    letters too once they have waited `schema_wait_slices` slices (`resolve_tasks`, which this
    runs only when either happens); `endings`: the slices whose waits end (`waits_ending`), `due`
    their files (`_due_waits`).
    Returns how many were applied."""
    held = files.pop(HELD, [])
    new = new_registrations(engine, files, registry or {})
    if not (new or due or (held and slice_key in endings)):
        files.setdefault("schema_waits", []).extend(held)
        return 0
    if registry is None:  # no envelope topic in the slice: the registry tells which due waits were applied since
        registry = _registry_before(engine, slice_key)
    earlier = due  # and, with new schemas, the earlier files whose schema ids' range holds one
    if new:
        earlier = [f for f in engine.files("schema_waits")
                   if f.min["slice"] < slice_key and (f.min["slice"] in endings or waits_for(f, new))]
    uri, rows = engine.uri("schema_waits"), slicing.max_messages_per_task
    waiting = sum(f.rows for f in held) + sum(f.rows for f in earlier)
    slots = task_slots(spark, waiting)  # a few messages: no Spark session for them
    tasks = [{"files": [f"{uri}/{f.path}" for f in t["files"]], "earlier": False}
             for t in file_tasks(held, rows, slots)]
    tasks += [{**t, "earlier": True} for t in file_tasks(earlier, rows, slots)]
    fn = partial(resolve_tasks, prefix=kafka.topic_prefix, sources=kafka.sources(), registry={**registry, **new},
                 new=frozenset(new), slice_key=slice_key, due=frozenset(endings),
                 table_uris={t: engine.uri(t) for t in TABLES}, storage_options=engine.storage_options)
    out = run_tasks(spark, tasks, fn, waiting)
    applied = pop_counts(out)["applied"]
    for table, written in out.items():
        files.setdefault(table, []).extend(written)
    _discard(engine, {HELD: held})  # rewritten by the tasks
    return applied


def _discard(engine, files: dict) -> None:
    """Deletes data files the tasks wrote that no commit will add."""
    for table, written in files.items():
        fs, root = filesystem(engine.uri(lake_table(table)), engine.storage_options)
        for f in written:
            fs.delete_file(f"{root}/{f.path}")


READ = "records"
"""Commit info of an ingest commit: the slice's records that Kafka held, which a re-run compares."""

STAMPS = "timestamps"
"""Commit info of an ingest commit: the sum of the records' Kafka timestamps (`STAMPS_MODULUS`), which a
re-run that reads as many compares."""


HIGHEST = "highest_ingested"
"""Commit info of an ingest commit: the highest slice ingested so far, this one included. Slices are
first ingested in order, so a slice above it is on its first run, however many re-runs of older
slices came since (a rebuild, a backfill)."""


def _highest_ingested(engine) -> str:
    """The highest slice ingested: the newest ingest commit says (`HIGHEST`); a lake of an older
    release, which recorded none, the highest of its newest commits."""
    highest = ""
    for n, commit in enumerate(engine.commits("entity_batches", "replace_slice")):
        highest = max(highest, commit["slice"], commit.get(HIGHEST, ""))
        if HIGHEST in commit or n + 1 >= RECENT_COMMITS:
            break
    return highest


def _changed_since(engine, slice_key: str, read: int, stamps: str, highest: str) -> str | None:
    """Why a re-run's records are not those the run that committed the slice read: fewer (a
    compacted topic dropped some since, or records were deleted), or as many with other
    timestamps (a topic deleted, created again and refilled past the slice's offsets: its new
    records would replace the lake's rows, and be read again by the next slices). None if they
    are, or on its first run, which `highest` (`_highest_ingested`) tells, so that a first run
    lists no table's files for it. Only a slice with rows has a commit to look for; once lake
    maintenance expired that commit from the log (or an older release recorded none), the
    slice's rows tell what it read."""
    if highest < slice_key:
        return None
    held = {table: files for table in TABLES if (files := engine.slice_files(table, [slice_key]))}
    if not held:
        return None
    # the first commit that records what it read (not `_keep`'s)
    entry = next((e for table in held if READ in (e := engine.commit_after(table, slice_key, "replace_slice") or {})),
                 None)
    before, was = (int(entry[READ]), entry.get(STAMPS, stamps)) if entry else _rows_read(engine, held)
    if read < before:
        return f"Kafka now holds {read} of its {before} records"
    if read > before or was != stamps:
        return (f"Kafka holds other records at its offsets ({read}) than the {before} it read (a topic "
                "deleted and created again?)")
    return None


def _rows_read(engine, held: dict[str, list]) -> tuple[int, str]:
    """How many records the slice's rows hold and the sum of their Kafka timestamps: a row per
    record read, in one of the tables' `held` files (dead letters of spans gone stand for none).
    A Qlik data message whose wait a later slice ended counts here no more: such a re-run keeps
    the rows."""
    count = total = 0
    for table, files in held.items():
        letters = table == "dead_letters"
        for data in read_tables(files, engine.storage_options, ["kafka_timestamp", *(["code"] if letters else [])]):
            if letters:
                data = data.filter(pc.not_equal(data.column("code"), DeadLetterCode.EXPIRED.value))
            count += data.num_rows
            total += pc.sum(data.column("kafka_timestamp")).as_py() or 0
    return count, str(total % STAMPS_MODULUS)


def _committed(engine, slice_key: str) -> list[str]:
    """The tables that a run of the slice committed before (all of them, or the first ones of a
    run that failed between its commits)."""
    return [table for table in TABLES if engine.reached(table, slice_key, "replace_slice")]


def _keep(context: AssetExecutionContext, engine, slice_key: str, files: dict, kept: list[str], changed: str | None,
          highest: str):
    """A re-run of an ingested slice whose records Kafka no longer all holds (retention, or
    compaction or a topic created again: `changed`): the rows of `kept`, the tables a run
    committed before, are their only copy, so they stay as they are and the steps after this
    one run on them. The other tables (a run that failed between its commits) take what Kafka
    still holds, and a dead letter for each span gone."""
    letters = [reason for f in files.get("dead_letters", []) for reason in read_table(
        f"{engine.uri('dead_letters')}/{f.path}", engine.storage_options, columns=["code", "reason"],
        filters=[("code", "=", DeadLetterCode.EXPIRED.value)]).column("reason").to_pylist()]
    said = letters[:3] + (["..."] if len(letters) > 3 else []) + ([changed] if changed else [])
    files.setdefault("schema_waits", []).extend(files.pop(HELD, []))  # they wait, as in a slice with no new schema
    _discard(engine, {table: files.pop(table, []) for table in kept})
    summary = commit_slice(engine, [t for t in TABLES if t not in kept], files, slice_key, metadata={HIGHEST: highest})
    context.log.warning(f"slice {slice_key} was ingested before, and Kafka no longer holds the records it read "
                        f"({'; '.join(said)}): its rows in "
                        f"{', '.join(kept)}, their only copy, are kept as they are"
                        + (f"; {', '.join(summary)} had no commit of the slice and take what Kafka still holds"
                           if summary else ""))
    for table in kept:
        rows = sum(f.rows for f in engine.slice_files(table, [slice_key]))
        summary[table] = {"rows": rows, "version": engine.version(table)}
    for table in TABLES:
        meta = table_metadata(engine, table, summary[table])
        if table in kept:
            meta["kept"] = MetadataValue.text(f"Kafka no longer holds the slice's records as read: the rows ingested "
                                              f"before are kept ({'; '.join(said)})")
        yield MaterializeResult(asset_key=table, metadata=meta)
    yield _dead_letters_check(_letters(engine, slice_key, summary["dead_letters"]["rows"]))


def _letters(engine, slice_key: str, dead: int) -> Counter:
    """(stream, code) -> the slice's dead letters; the table is read only when it has some."""
    if not dead:
        return Counter()
    rows = engine.read("dead_letters", columns=["slice", "stream", "code"], where={"slice": slice_key})
    counts = rows.group_by(["stream", "code"]).aggregate([([], "count_all")])  # in Arrow: a backlog's may be millions
    return Counter({(stream, code): n for stream, code, n in zip(*(counts.column(c).to_pylist() for c in (
        "stream", "code", "count_all")))})


NOT_THE_PRODUCERS = (DeadLetterCode.EXPIRED.value, DeadLetterCode.UNEXPECTED.value)
"""Dead letters that no producer's mistake explains: records Kafka deleted before the slice read
them (input lost), and errors no check foresaw (ours to fix). The check says them as errors."""


def _dead_letters_check(letters: Counter) -> AssetCheckResult:
    """A warning, not a failure: bad input is expected of producers, and the slice's good records
    went on. An error (still not failing the run) where a dead letter is `NOT_THE_PRODUCERS`'."""
    by_code = {f"{stream} {code}": n for (stream, code), n in sorted(letters.items())}
    ours = sum(n for (_, code), n in letters.items() if code in NOT_THE_PRODUCERS)
    return AssetCheckResult(asset_key="dead_letters", check_name="no_dead_letters", passed=not letters,
                            severity=AssetCheckSeverity.ERROR if ours else AssetCheckSeverity.WARN,
                            metadata={"dead_letters": MetadataValue.int(letters.total()),
                                      "lost_or_unforeseen": MetadataValue.int(ours),
                                      "by_stream_and_code": MetadataValue.json(by_code)})
