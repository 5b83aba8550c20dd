"""The Kafka offsets sensor: closes slices from new offsets and requests one run per slice."""


import json
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from typing import NamedTuple

from dagster import (AssetKey, AssetObservation, DagsterInstance, DagsterRun, DagsterRunStatus, RunRecord, RunRequest,
                     RunsFilter, SensorEvaluationContext, SensorResult, SkipReason, sensor)

from entity_assets.assets.topics import topic_key
from entity_assets.jobs import slice_job
from entity_assets.manifests import ManifestStore
from entity_assets.partitions import LAKE_POOL, slices_partitions
from entity_assets.slices import Manifest, behind, plan_slices, read_to, run_key, slice_key, slice_seq
from entity_assets.storage import NOTES_FOLDER
from entity_assets.tables import APPLIED_IN_ORDER
from resources import KafkaResource, LakeResource, SlicingResource


class Cursor(NamedTuple):
    seq: int
    """The last slice requested."""
    positions: dict
    """Where the next slice starts."""
    closed_at: int | None
    """When the last slice closed (ms)."""
    lag: dict | None = None
    """What the last lag report said (`report_lag`)."""
    adopted: int = 0
    """The last slice this instance took as done without running it (`adopted`): a lake restored
    behind it lacks slices whose runs another instance made."""


def load_cursor(raw: str | None) -> Cursor:
    if not raw:
        return Cursor(0, {}, None)
    data = json.loads(raw)
    return Cursor(data["seq"], _positions(data["next"]), data.get("closed_at"), data.get("lag"), data.get("adopted", 0))


def _positions(keyed: dict[str, int]) -> dict[tuple[str, int], int]:
    """Offsets by (topic, partition) from their JSON form, keyed `topic|partition` (`_keyed`)."""
    return {(tp.rsplit("|", 1)[0], int(tp.rsplit("|", 1)[1])): off for tp, off in keyed.items()}


def _keyed(positions: dict[tuple[str, int], int]) -> dict[str, int]:
    return {f"{t}|{p}": off for (t, p), off in sorted(positions.items())}


def not_the_lake(root: str, ran: str) -> str:
    """What a lake with no slice is, where the sensor or the instance ran some: no backup lacks
    every slice, so another lake (a root mistyped, moved, or relative to another folder), which
    would read all Kafka holds again and publish it again, creations as patches of missing entities."""
    return (f"the lake at {root} has no slice, but {ran}: is its root the lake's (ENTITY_ASSETS_LAKE)? To start "
            "this lake from the first offsets Kafka holds, use a new Dagster instance (DAGSTER_HOME)")


def dump_cursor(seq: int, positions: dict, closed_at: int | None, lag: dict | None = None, adopted: int = 0) -> str:
    return json.dumps({"seq": seq, "next": _keyed(positions),
                       "closed_at": closed_at, **({"lag": lag} if lag else {}),
                       **({"adopted": adopted} if adopted else {})})


@sensor(job=slice_job, minimum_interval_seconds=30, description="Closes a slice of new Kafka offsets and requests its run.")
def kafka_offsets_sensor(context: SensorEvaluationContext, kafka: KafkaResource, lake: LakeResource,
                         slicing: SlicingResource):
    """The manifest table, not the cursor, is the truth.

    The cursor (last requested slice, next offsets) saves a lake read per tick. If manifests
    exist past the cursor (a tick that wrote them and died, a lost cursor, slices closed by the
    CLI), the sensor resumes from the newest manifest and requests those slices again but for
    those done (`_to_run_again`). A lake behind the cursor (restored from a backup) closes its
    next slices again, under new run keys (`Manifest.run_key`); a tick that closes a slice also
    requests again those whose runs succeeded but whose state the lake lacks.
    The tick reads the manifests as of its first look (`snapshot`): of two ticks closing the
    same slice at once, Delta refuses the second commit (same app transaction).
    """
    engine = lake.open(snapshot=True)
    store = ManifestStore(engine)
    cursor = load_cursor(context.cursor)
    latest = store.latest_seq()
    if not latest and cursor.seq:
        said = not_the_lake(engine.root, f"this sensor closed {cursor.seq}") + (
            ", or delete the sensor's cursor: `dagster sensor cursor kafka_offsets_sensor --delete` (docs/slices.md)")
        context.log.error(said)
        return SensorResult(skip_reason=SkipReason(said), cursor=context.cursor)
    cursor_seq, read, closed_at = _resumed(context, store, lake, cursor, latest)
    reported, taken = cursor.lag, cursor.adopted
    # `read`, the slices' offsets, is what the cursor keeps: a partition no slice has read starts
    # where Kafka's first offset is when a slice reads it, not when a tick first saw it
    marks, firsts, positions, ends, unread = _offsets(context, kafka, read)
    planned, ends, still_held, went_back = _went_back(context, engine, slicing, positions, ends, marks, firsts)
    latest_closed = closed_at  # of the newest slice before this tick's
    new = plan_slices(planned, ends, policy=slicing.policy(), next_seq=latest + 1,
                      last_closed_at=closed_at, now=int(time.time() * 1000), firsts=firsts)
    for manifest in new:
        store.write(manifest)
    if still_held is not None and new:  # a manifest holds the restarted offsets now; without one, the next tick restarts
        engine.write_note(WENT_BACK, json.dumps(_keyed(still_held)))
    if new:
        read, closed_at = new[-1].positions(), new[-1].closed_at
    last = new[-1].seq if new else latest
    requested = {m.seq: m.run_key for m in new}
    healed: dict[int, int] = {}
    if latest and latest_closed is not None and stopped(context.instance, latest, latest_closed):
        engine = lake.open()
        healed = held_back(context.instance, engine, store, latest, lake_holds(engine, newest=min))
    if healed:
        context.log.info(f"slices {', '.join(map(slice_key, healed))}: their runs stopped while a slice before them "
                         "was missing, which is done now: requested again")
        now = int(time.time() * 1000)
        requested.update({seq: f"{run_key(slice_key(seq), closed)}~{now}" for seq, closed in healed.items()})
    if new or latest > cursor_seq:
        again, taken = _to_run_again(context, store, lake, cursor_seq, last, {m.seq: m.closed_at for m in new},
                                     set(healed), taken)
        requested.update({seq: key for seq, key in again.items() if seq not in requested})
    keys = [slice_key(seq) for seq in sorted(requested)]
    # `context.log` opens the tick's log file, which tick retention never deletes: only when there is a warning
    observations, reported = report_lag(lambda text: context.log.warning(text), context.instance, kafka, store, marks,
                                        last, reported)
    next_cursor = dump_cursor(last, read, closed_at, reported, taken)
    if not keys:
        pending = sum(max(0, ends[tp] - positions.get(tp, 0)) for tp in ends)
        return SensorResult(skip_reason=SkipReason(f"no slice closed ({pending} messages pending)"
                                                    + "".join(f"; {said}" for said in (went_back, unread) if said)),
                            cursor=next_cursor,
                            asset_events=observations)
    context.log.info(f"requesting slices {keys[0]}..{keys[-1]}")
    if warning := pool_warning(context.instance):
        context.log.warning(warning)
    manifests = {m.seq: m for m in new}
    manifests.update(store.get_many(set(requested) - manifests.keys()))  # slices requested again: one read
    return SensorResult(
        run_requests=[RunRequest(run_key=requested[seq], partition_key=slice_key(seq), tags=slice_tags(manifests[seq]))
                      for seq in sorted(requested)],
        dynamic_partitions_requests=[slices_partitions.build_add_request(keys)],
        cursor=next_cursor,
        asset_events=observations,
    )


def _resumed(context, store: ManifestStore, lake: LakeResource, cursor: Cursor,
             latest: int) -> tuple[int, dict, int | None]:
    """(last slice requested, next offsets, last close) with the lake's manifests over the cursor.

    The same number may be another slice: a lake restored behind the cursor whose lost slices
    the CLI closed again (`entity-assets run`), as many as it lost; its newest tells by its close."""
    cursor_seq, positions, closed_at = cursor.seq, cursor.positions, cursor.closed_at
    if latest != cursor_seq or (latest and store.closed_at().get(latest) != closed_at):
        newest = store.get(latest) if latest else None
        positions = newest.positions() if newest else {}
        closed_at = newest.closed_at if newest else None
        if latest < cursor_seq:
            context.log.warning(f"cursor at slice {cursor_seq} but the lake has {latest} (restored from a backup?): "
                                "resuming from the lake")
            cursor_seq = latest
        elif latest == cursor_seq and latest:  # the CLI's slices past what the lake held: not this sensor's requests
            cursor_seq = min(cursor_seq, lake_holds(lake.open()))
    return cursor_seq, positions, closed_at


def _offsets(context, kafka: KafkaResource, positions: dict) -> tuple[dict, dict, dict, dict, str]:
    """Kafka's (first, end) offsets of the input partitions, the first of each, the next
    positions (a partition no slice has read starts at the first offset Kafka holds), the ends
    (topics the broker did not list keep their positions) and why none was read, if so."""
    unanswered: list[str] = []
    marks = kafka.input_watermarks(unanswered=unanswered)
    if unanswered:  # their positions stay (`ends` below): they go on at a later tick
        context.log.warning(f"no offsets from {'; '.join(unanswered)}: this slice leaves those partitions out")
    unread = "" if marks or unanswered else no_input_topic(kafka)
    if unread:  # a mistyped prefix or another cluster would look idle
        context.log.warning(unread)
    firsts = {tp: low for tp, (low, _) in marks.items()}
    ends = {**positions, **{tp: high for tp, (_, high) in marks.items()}}
    return marks, firsts, {**firsts, **positions}, ends, unread


def _went_back(context, engine, slicing: SlicingResource, positions: dict, ends: dict, marks: dict, firsts: dict):
    """Partitions whose offsets went back (`behind`), with every partition of their topic: a topic
    created again, whose partitions with new records past the slices' offsets before a tick looked
    cannot be told from their old selves (nor can a log an unclean election cut short from a topic
    created again). Held, in the lake's note (`WENT_BACK`), until the user says how to go on
    (`offsets_went_back`): `restart` reads them from their first offsets, `continue` from the
    slices' offsets once each partition's end is past them.

    Returns the offsets to plan from, the ends to plan to (a held partition's: its offset), the
    note once a slice holds a restart's offsets (None: no restart), and what a tick that closes no
    slice says of them."""
    held, mode = went_back_before(engine), slicing.offsets_went_back
    topics = {t for t, _ in behind(positions, ends)}
    back = sorted({*(tp for tp in marks if tp[0] in topics), *(tp for tp in held if tp in marks)})
    if mode == "continue":
        if held:
            engine.write_note(WENT_BACK, "{}")
        if back:
            context.log.warning(f"offsets went back: {', '.join(f'{t}[{p}]' for t, p in back)}; read on from the "
                                "slices' offsets once each partition's end is past them")
        return positions, ends, None, ""
    if not held.keys() >= set(back):  # held until the user decides: the topic growing past says nothing
        held = {**{tp: positions[tp] for tp in back}, **held}
        engine.write_note(WENT_BACK, json.dumps(_keyed(held)))
    unheard = sorted(tp for tp in held if tp not in marks)  # no offsets from Kafka: held still
    said = ", ".join([*(f"{t}[{p}] ends at {ends[(t, p)]}, next {held[(t, p)]}" for t, p in back),
                      *(f"{t}[{p}] gives no offsets, next {held[(t, p)]}" for t, p in unheard)])
    if not said:
        return positions, ends, None, ""
    if back and mode == "restart":
        context.log.warning(f"offsets went back: {said}; read again from their first offsets"
                            + (", but those Kafka gives no offsets of stay held" if unheard else ""))
        return ({**positions, **{tp: firsts[tp] for tp in back}}, ends,
                {tp: off for tp, off in held.items() if tp not in back}, "")
    note = engine.uri(f"{NOTES_FOLDER}/{WENT_BACK}")
    said = f"offsets went back: {said}. " + (
        "Held until Kafka gives offsets of them, then read again from their first offsets" if mode == "restart" else
        "The topic was deleted and created again, or the bootstrap servers name another cluster, or a leader "
        "election cut a log short; those partitions are held, none of their records read, until "
        "offsets_went_back is restart (read from their first offsets: a topic created again) or continue (read on "
        "from the slices' offsets: the same cluster again, a log cut short)") + f" (the note {note}; docs/slices.md)"
    context.log.error(said)
    return ({**positions, **{tp: held[tp] for tp in back}}, {**ends, **{tp: held[tp] for tp in back}}, None, said)


WENT_BACK = "offsets-went-back"
"""The lake's note of the partitions held since their offsets went back: `{"topic|partition": next
offset}`. In the lake, not the cursor: `entity-assets run` ticks with a cursor of the manifests."""


def went_back_before(engine) -> dict[tuple[str, int], int]:
    """The partitions held since their offsets went back (`WENT_BACK`), and the slices' next offset of each."""
    return _positions(json.loads(engine.read_note(WENT_BACK) or "{}"))


def no_input_topic(kafka: KafkaResource) -> str:
    """What the sensor says of a cluster without one input topic under the prefix."""
    from entity_assets.ingest import INPUT_STREAMS

    return (f"Kafka at {kafka.config()['bootstrap.servers']} has no input topic: none of "
            f"{', '.join(kafka.topic(s) for s in INPUT_STREAMS)}, nor an ingestion topic under the prefix "
            f"{kafka.topic_prefix!r}. Is the prefix (ENTITY_ASSETS_TOPIC_PREFIX) or the cluster another? "
            "`entity-assets topics` creates the input topics")


LAG_EVERY = 5 * 60 * 1000
"""While nothing changes (no slice closed, no run succeeded), the lag is looked at again this
often (ms): a lake still behind (a failed slice holding the others back) is observed again, its
`seconds_behind` growing in the UI's plot, and a commit that failed is tried again. Every tick
(30 s) would fill the event log, and read each state table's log (on an object store, requests)."""


def report_lag(warn: Callable[[str], None], instance: DagsterInstance, kafka: KafkaResource, store: ManifestStore,
               marks: dict, last: int, reported: dict | None) -> tuple[list[AssetObservation], dict]:
    """How far the lake's state is behind Kafka, observed on each input topic's asset: `lag`, the
    messages its topics hold past the last slice every state table holds (`slices.read_to`);
    `seconds_behind`, since the oldest slice not done closed (0: the stream's lag is, or every
    slice closed is done: messages not in a slice yet wait for the slice policy, not for the
    lake); `slices_not_done`; `last_slice_done`. Looked at when a slice closed, a slice's run
    succeeded since, or `LAG_EVERY` passed; observed when the slices changed, or while behind. The
    slice done's offsets go to the slices' consumer group (`KafkaResource.commit_offsets`) once,
    again at the next look after a failure: Kafka's own lag tools then show the lag too.

    Returns the observations and what the cursor keeps of them (`reported`). A failure is a
    warning, and the next look waits as after a report: the lag is a report, and must not stop
    the slices, nor read the state tables at every tick."""
    was, now = reported or {}, int(time.time() * 1000)
    runs = was.get("runs")
    try:
        runs, slice_ran = _runs_since(instance, runs)
        if was and was.get("last") == last and not slice_ran and now - was.get("at", 0) < LAG_EVERY:
            return [], {**was, "runs": runs}
        return _report_lag(warn, kafka, store, marks, last, was, now, runs)
    except Exception as exc:  # noqa: BLE001
        warn(f"lag not reported: {type(exc).__name__}: {exc}")
        return [], {**was, "at": now, "last": last, "runs": runs}


def _report_lag(warn, kafka, store, marks, last, was: dict, now: int, runs) -> tuple[list[AssetObservation], dict]:
    holds = min(lake_holds(store.engine, newest=min), last)  # manifests are the tick's snapshot
    positions = read_to(store.get(holds).positions() if holds else {}, marks)
    by_stream = {stream: 0 for stream in was.get("streams", ())}  # a stream whose topics are gone: 0
    for tp, position in positions.items():
        if (stream := kafka.input_stream(tp[0])) is not None:
            by_stream[stream.name] = by_stream.get(stream.name, 0) + marks[tp][1] - position
    committed = was.get("committed")
    if holds and positions and kafka.commit_offsets and committed != holds:
        try:
            kafka.commit(positions)
            committed = holds
        except Exception as exc:  # noqa: BLE001 (confluent-kafka raises ValueError on some settings)
            warn(f"slice {slice_key(holds)} is done, but its offsets were not committed ({exc}); tried again at the "
                 f"next look, within {LAG_EVERY // 60000} minutes. Kafka's lag tools show the group behind until "
                 "then: grant Read on the group, or set ENTITY_ASSETS_KAFKA_COMMIT_OFFSETS=false (docs/operations.md)")
    state = {"at": now, "holds": holds, "last": last, "runs": runs, "committed": committed,
             "streams": sorted(stream for stream, count in by_stream.items() if count)}
    if (was.get("holds"), was.get("last")) == (holds, last) and not (was.get("streams") or state["streams"]):
        return [], state  # caught up, as it was
    behind = round((now - store.get(holds + 1).closed_at) / 1000, 1) if last > holds else 0.0
    metadata = {"slices_not_done": last - holds, **({"last_slice_done": slice_key(holds)} if holds else {})}
    return [AssetObservation(topic_key(stream), metadata={"lag": count, "seconds_behind": behind if count else 0.0,
                                                          **metadata})
            for stream, count in sorted(by_stream.items())], state


def _runs_since(instance: DagsterInstance, seen: float | None) -> tuple[float | None, bool]:
    """When the newest run that succeeded after `seen` ended (s, by its worker's clock: a clock
    behind the others' may hide its run until the next `LAG_EVERY` look), else `seen`; and
    whether one of those ran a slice, and so may have applied it."""
    after = datetime.fromtimestamp(seen, timezone.utc) if seen is not None else None
    records = instance.get_run_records(RunsFilter(statuses=[DagsterRunStatus.SUCCESS], updated_after=after),
                                       limit=1 if after is None else 100)
    newest = max((r.update_timestamp.timestamp() for r in records), default=seen or 0.0)  # 0: none yet
    return newest, after is not None and any(_is_slice(r.dagster_run.tags.get(PARTITION_TAG)) for r in records)


def _is_slice(partition: str | None) -> bool:
    try:
        return partition is not None and slice_seq(partition) > 0
    except ValueError:
        return False


def pool_warning(instance: DagsterInstance) -> str | None:
    """What the instance lacks for the slices' runs to apply in order, or None. Pools count per
    step unless the instance says `granularity: run`: two slices' runs could then interleave
    their steps, and the later one's state step refuses (OutOfOrder), failing its run. A pool
    without a limit (a shared instance, none set and no `default_limit`) or above 1 lets them
    start together, and so does one whose limit is the `default_limit` alone, until a dequeue
    has created the pool."""
    granularity = instance.get_concurrency_config().pool_config.pool_granularity
    per = getattr(granularity, "value", granularity) or "op"  # Dagster's PoolGranularity; unset: per op
    if per != "run":
        return (f"this instance's concurrency pools count per {per}, not per run: two slices' runs may "
                f"interleave their steps and fail with OutOfOrder. Set `concurrency: pools: granularity: run` in its "
                f"dagster.yaml and limit the pool {LAKE_POOL} to 1 (docs/operations.md)")
    storage = instance.event_log_storage
    limit = storage.get_concurrency_info(LAKE_POOL).limit if storage.supports_global_concurrency_limits else None
    if limit != 1:
        return (f"this instance's pool {LAKE_POOL} " + (f"is limited to {limit} runs" if limit else "has no limit")
                + f": slices' runs may start together and fail with OutOfOrder. Limit it to 1: "
                  f"`dagster instance concurrency set {LAKE_POOL} 1` (docs/operations.md)")
    if LAKE_POOL not in storage.get_concurrency_keys():
        return (f"this instance's pool {LAKE_POOL} is limited to 1 only by dagster.yaml's default_limit, which "
                "Dagster applies after the first dequeue that sees the pool: slices' runs queued before it start "
                f"together and fail with OutOfOrder. Set it: `dagster instance concurrency set {LAKE_POOL} 1` "
                "(docs/operations.md)")
    # the queue starts runs in the order they were created, which submit workers make concurrent
    # (the sensor daemon's workers only with its `use_threads`, which is off unless set; the backfill daemon's is on)
    settings = {part: instance.get_settings(part) for part in ("sensors", "backfills")}
    workers = [part for part, threads in (("sensors", False), ("backfills", True))
               if settings[part].get("num_submit_workers") and settings[part].get("use_threads", threads)]
    if workers:
        return (f"this instance's {' and '.join(workers)} set num_submit_workers: a tick's or a backfill's slices' "
                "runs are created, so queued and started, out of slice order, and the later ones fail with "
                "OutOfOrder until the earlier are done. Leave it unset (docs/operations.md)")
    return None


STOPPED = (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
"""A run that ended without applying its slice: failed, or cancelled (slices queued behind a failed one, say)."""


def _to_run_again(context, store: ManifestStore, lake: LakeResource, cursor_seq: int, last: int,
                  closing: dict[int, int], healed: set[int], taken: int) -> tuple[dict[int, str], int]:
    """Run keys of the slices up to `last` that this tick did not close (`closing`: their
    closing times) and that are not done: past the cursor (a lost cursor, slices closed by
    `entity-assets run`), or past what the lake's state holds (a lake restored from a backup);
    and the last slice this instance took as done (`taken`, from the cursor, or set now).

    Skipped: a slice done, and one below the cursor not done (requested already). A slice whose
    newest whole run (`newest_whole`) succeeded but that the lake lacks gets a run key of this
    tick, as the daemon skips a run key it has seen. Any other past the cursor gets its own: the
    daemon skips it if it launched a run under that key (in flight, or failed), and runs it after
    a run of another launcher, such as a killed `entity-assets run`, whose run monitoring fails."""
    closed = {**store.closed_at(), **closing}
    first = min(cursor_seq, lake_holds(lake.open())) + 1
    if first > last:
        return {}, taken
    runs = slice_runs(context.instance, {seq: closed[seq] for seq in range(first, last + 1)})
    holds = lake_holds(lake.open())  # again, after the runs: a run that succeeded since has committed its state
    now_taken = adopted(runs, lake.open()) if cursor_seq == 0 else 0  # no cursor: `runs` are all of the slices'
    if now_taken:
        context.log.warning(f"this instance has run no slice, and the lake's every state holds slices up to "
                            f"{slice_key(now_taken)}: taken as done (a new Dagster instance over this lake)")
        taken = now_taken
    undone = {seq: closed[seq] for seq in range(max(min(cursor_seq, holds), now_taken) + 1, last + 1)
              if seq not in closing and not done(runs, seq, holds)}
    whole = newest_whole(context.instance, undone)
    # a slice taken as done ran on another instance: one the lake lacks (restored behind it) runs again
    whole.update({seq: DagsterRunStatus.SUCCESS for seq in undone if seq <= taken and seq not in whole})
    if DagsterRunStatus.SUCCESS in whole.values():
        # a run that succeeded since the runs were read committed its state before: look again
        holds = lake_holds(lake.open())
    now, out = int(time.time() * 1000), {}
    for seq in undone:
        status = whole.get(seq)
        if status == DagsterRunStatus.SUCCESS:
            if seq > holds:
                out[seq] = f"{run_key(slice_key(seq), closed[seq])}~{now}"
                context.log.warning(f"slice {slice_key(seq)} ran, but the lake lacks its state (restored?): "
                                    "requested again")
        elif seq > cursor_seq:  # below the cursor, requested already
            out[seq] = run_key(slice_key(seq), closed[seq])
        elif status in STOPPED and seq not in healed:
            ended = "failed" if status == DagsterRunStatus.FAILURE else "was cancelled"
            context.log.warning(f"slice {slice_key(seq)}: its last run {ended} and the lake lacks its state; the "
                                "slices after it wait for it: re-run it from the UI (its failed steps, or the whole "
                                "run), or turn this sensor off and run `entity-assets run --slices "
                                f"{seq}` (it refuses beside a running sensor)")
    return out, taken


MESSAGES_TAG = "entity-assets/messages"
"""A slice run's input messages, from its manifest: the UI's runs list shows each slice's size."""


def slice_tags(manifest: Manifest) -> dict[str, str]:
    return {MESSAGES_TAG: str(manifest.messages)}


PARTITION_TAG = "dagster/partition"
"""The tag Dagster gives a partition's runs, whatever launched them (a sensor, a backfill, the UI)."""
ROOT_RUN_TAG = "dagster/root_run_id"
"""The tag of a re-execution: the run its chain of re-executions started from."""

STATE_ASSETS = frozenset(AssetKey(a) for a in ("entities", "schemas", "learned_schemas", "devices", "device_notifications"))
"""An asset of each step that applies a state table (`APPLIED_IN_ORDER`)."""


def _whole(run: DagsterRun) -> bool:
    """Whether the run applies every state: a run of the job with no selection, or a selection
    holding every state step (the UI's Materialize all, a backfill)."""
    if run.op_selection:
        return False
    if run.asset_selection:
        return STATE_ASSETS <= run.asset_selection
    return run.job_name == slice_job.name and not run.asset_check_selection


def newest_whole(instance: DagsterInstance, closed_at: dict[int, int]) -> dict[int, DagsterRunStatus]:
    """Slice -> the status of its newest whole run since it closed (`newest_whole_records`)."""
    return {seq: record.dagster_run.status for seq, record in newest_whole_records(instance, closed_at).items()}


def newest_whole_records(instance: DagsterInstance, closed_at: dict[int, int]) -> dict[int, RunRecord]:
    """Slice -> the record of its newest run since it closed (one not started yet counts) that
    is whole (`_whole`) or a re-execution of a whole run (the UI's From failure, From asset
    failure): runs of some assets only neither hide it nor stand for it. After a restore, its
    success means the lake lost the slice's state; a whole run in flight or failed since (a
    request of the sensor's, run or not) means it was asked for again. A slice only subsets ran
    may never have had its state applied: the sensor leaves it to the user. The runs' records
    are read newest first, in a query per `_KEYS_PER_QUERY` slices."""
    if not closed_at:
        return {}
    keys = [slice_key(seq) for seq in closed_at]
    records = [r for i in range(0, len(keys), _KEYS_PER_QUERY)
               for r in instance.get_run_records(RunsFilter(tags={PARTITION_TAG: keys[i:i + _KEYS_PER_QUERY]},
                                                            created_after=_first_closing(closed_at)))]
    by_id = {r.dagster_run.run_id: r for r in records}
    out: dict[int, RunRecord] = {}
    for record in records:
        run = record.dagster_run
        seq = int(run.tags[PARTITION_TAG])
        root = by_id.get(run.tags.get(ROOT_RUN_TAG, run.run_id))  # None: a run of the key before the slice closed
        if seq not in out and root is not None and _whole(root.dagster_run) \
                and _started_since(root.start_time or root.end_time, closed_at[seq]):
            out[seq] = record
    return out


def stopped(instance: DagsterInstance, seq: int, closed_at: int) -> bool:
    """Whether the slice's newest whole run ended without applying it (`STOPPED`): one query."""
    newest = newest_whole_records(instance, {seq: closed_at}).get(seq)
    return newest is not None and newest.dagster_run.status in STOPPED


def held_back(instance: DagsterInstance, engine, store: ManifestStore, last: int, holds: int) -> dict[int, int]:
    """The slices after the last one every state table holds (`holds`) whose newest whole runs
    stopped (`STOPPED`) before it was done, up to `last` and the first that did not stop: a
    slice's run refuses (OutOfOrder) while a slice before it is missing, so one slice that failed
    and was then run again (the UI, `entity-assets run`) left every later slice failed, or
    cancelled by whoever stopped the queue. Each is asked for once: a slice whose run stops after
    the slice before it is done stopped on its own, and waits for the user (`_to_run_again` warns).

    Returns each one's closing time. The sensor asks only while the newest slice's run stopped
    (`stopped`); the run history read is that of the slice done and the next, and of the later
    ones (with every manifest) only when the next is held back."""
    if not holds or holds >= last:
        return {}
    closed = {seq: store.get(seq).closed_at for seq in (holds, holds + 1)}
    done_at = _done_at(instance, engine, holds, closed[holds])
    first = newest_whole_records(instance, {holds + 1: closed[holds + 1]}).get(holds + 1)
    if done_at is None or first is None or first.dagster_run.status not in STOPPED \
            or (first.end_time or 0) > done_at:
        return {}
    closed = store.closed_at()
    records = newest_whole_records(instance, {seq: closed[seq] for seq in range(holds + 1, last + 1)})
    out = {}
    for seq in range(holds + 1, last + 1):
        if seq not in records or records[seq].dagster_run.status not in STOPPED:
            break  # in flight, or never run whole: the slices after it wait for it, as for a failed one
        out[seq] = closed[seq]
    return out  # slice -> its closing time


def _done_at(instance: DagsterInstance, engine, seq: int, closed_at: int) -> float | None:
    """When the slice was done: the end of its first successful run (of any selection: a re-run of
    only the failed assets too) since its state tables' last apply commit, the one that finished
    it (a run may apply and then fail to publish); None: none. Not the newest successful run's:
    a replay of the slice's assets since (the UI) would make the next slice, failed on its own
    after the slice was done, look held back. Where the log no longer holds an apply commit, the
    newest successful run since the slice closed stands in."""
    times = [c["timestamp"] if c else None for t in APPLIED_IN_ORDER if engine.exists(t)
             for c in [engine.commit_after(t, slice_key(seq), "apply")]]
    applied = max(times) / 1000 if times and None not in times and min(times) >= closed_at else None
    ends = [record.end_time or time.time() for record in instance.get_run_records(
        RunsFilter(tags={PARTITION_TAG: slice_key(seq)}, statuses=[DagsterRunStatus.SUCCESS],
                   created_after=_first_closing({seq: closed_at})), limit=50)
        if _started_since(record.start_time or record.end_time, closed_at)]
    if applied is None:
        return max(ends, default=None)
    return min((end for end in ends if end >= applied), default=None)


_KEYS_PER_QUERY = 1000
"""Partition keys per run-records query: SQLite takes at most 32,766 parameters in one."""


def done(runs: dict[int, str], seq: int, holds: int) -> bool:
    """Whether a slice is done: a run of it succeeded since it closed (`slice_runs`), and the
    lake's state holds it (`lake_holds`)."""
    return seq in runs and seq <= holds


def adopted(runs: dict[int, str], engine) -> int:
    """The slices an instance that has run none (`runs`: `slice_runs` over every slice closed)
    takes as done: those every state table of the lake holds. A new instance over a lake (from
    SQLite to Postgres, a new DAGSTER_HOME) would otherwise run them all again: hours of runs
    ahead of the new slices, whose replays fail once the vacuum has passed them."""
    return 0 if runs else lake_holds(engine, newest=min)


def lake_holds(engine, tables: Iterable[str] = APPLIED_IN_ORDER, newest=max) -> int:
    """The last slice the lake's state holds (0: none): the newest that a state table of `tables`
    applied. A restore rolls them all back, where a table deleted to be rebuilt lags alone.
    `newest=min`: the last slice every state table holds (a failed run may have applied some)."""
    from entity_assets.assets.common import STATE_APP

    return newest((engine.applied(t, STATE_APP) or 0 for t in tables if engine.exists(t)), default=0)


def slice_runs(instance: DagsterInstance, closed_at: dict[int, int]) -> dict[int, str]:
    """Slice -> the id of its newest successful run (of any selection, the UI's asset jobs
    included) since the slice closed: a run of the slice key before that ran other offsets (a
    lake restored behind its runs closes those slices again). A run without a start time (an
    instance without run stats) counts. Reads the partition, status and time columns of the
    runs created since the first slice closed: no run record is deserialized.
    """
    if not closed_at:
        return {}
    out: dict[int, str] = {}
    for seq, d in successful_slice_runs(instance, created_after=_first_closing(closed_at)):
        if seq in closed_at and _started_since(d.start_time or d.end_time, closed_at[seq]):
            out[seq] = d.run_id
    return out


def successful_slice_runs(instance: DagsterInstance, created_after: datetime | None = None):
    """(slice, its partition data) of each successful run of a slice partition (not one added by
    hand), from the partition, status and time columns alone."""
    for d in instance.get_run_partition_data(RunsFilter(statuses=[DagsterRunStatus.SUCCESS],
                                                        created_after=created_after)):
        try:
            yield slice_seq(d.partition), d
        except ValueError:  # a partition added by hand, not a slice's
            continue


CLOCK_MARGIN = timedelta(minutes=5)
"""Runs created this long before a slice closed are read too: a run's creation time is the run
storage's clock (Postgres's `CURRENT_TIMESTAMP`), which may lag this host's, and the sensor's
request is created within a second of the close. `_started_since` then tells the slice's runs
by their start, which the run's own process records. (A database whose time zone is not UTC is
hours off: docs/operations.md.)"""


def _first_closing(closed_at: dict[int, int]) -> datetime:
    """When the first of the slices closed, less `CLOCK_MARGIN`: no run created before it is a run of theirs."""
    return datetime.fromtimestamp(min(closed_at.values()) / 1000, timezone.utc) - CLOCK_MARGIN


def _started_since(started: float | None, closed_at: int) -> bool:
    """Whether a run (its start, else its end, in seconds) ran the slice that closed at `closed_at`
    (ms), not the offsets an earlier slice of its key had; a run without a time (an instance
    without run stats) counts."""
    return started is None or started * 1000 >= closed_at
