"""The Kafka offsets sensor: closes slices from new offsets and requests one run per slice."""


import json
import time
from collections.abc import Iterable

from dagster import DagsterInstance, DagsterRunStatus, RunRequest, RunsFilter, SensorEvaluationContext, SensorResult, SkipReason, sensor

from entity_assets.jobs import slice_job
from entity_assets.manifests import ManifestStore
from entity_assets.partitions import slices_partitions
from entity_assets.slices import behind, plan_slices, run_key, slice_key
from entity_assets.tables import APPLIED_IN_ORDER
from resources import KafkaResource, LakeResource, SlicingResource


def load_cursor(raw: str | None) -> tuple[int, dict, int | None]:
    if not raw:
        return 0, {}, None
    data = json.loads(raw)
    positions = {(tp.rsplit("|", 1)[0], int(tp.rsplit("|", 1)[1])): off for tp, off in data["next"].items()}
    return data["seq"], positions, data.get("closed_at")


def dump_cursor(seq: int, positions: dict, closed_at: int | None) -> str:
    return json.dumps({"seq": seq, "next": {f"{t}|{p}": off for (t, p), off in sorted(positions.items())},
                       "closed_at": closed_at})


@sensor(job=slice_job, minimum_interval_seconds=30, description="Closes a slice of new Kafka offsets and requests its run.")
def kafka_offsets_sensor(context: SensorEvaluationContext, kafka: KafkaResource, lake: LakeResource,
                         slicing: SlicingResource):
    """The manifest table, not the cursor, is the truth.

    The cursor (last requested slice, next offsets) saves a lake read per tick. If manifests
    exist past the cursor (a tick that wrote them and died, a lost cursor, slices closed by the
    CLI), the sensor resumes from the newest manifest and requests those slices again but for
    those done (`_catching_up`). A lake behind the cursor (restored from a backup) closes its
    next slices again, under new run keys (`Manifest.run_key`), and requests those it lacks.
    The tick reads the manifests as of its first look (`snapshot`): of two ticks closing the
    same slice at once, Delta refuses the second commit (same app transaction).
    """
    engine = lake.open(snapshot=True)
    store = ManifestStore(engine)
    cursor_seq, positions, closed_at = load_cursor(context.cursor)
    latest = store.latest_seq()
    if latest != cursor_seq:
        newest = store.get(latest) if latest else None
        positions = newest.positions() if newest else {}
        closed_at = newest.closed_at if newest else None
        if latest < cursor_seq:
            holds = lake_holds(engine)
            context.log.warning(f"cursor at slice {cursor_seq} but the lake has {latest} (restored from a backup?), "
                                f"its state slice {holds}: resuming from the lake")
            cursor_seq = min(latest, holds)

    marks = kafka.input_watermarks()
    firsts = {tp: low for tp, (low, _) in marks.items()}
    ends = {**positions, **{tp: high for tp, (_, high) in marks.items()}}  # keep topics the broker did not list
    positions = {**firsts, **positions}  # a partition no slice has read starts at the first offset Kafka holds
    back = behind(positions, ends)
    went_back = ", ".join(f"{t}[{p}] ends at {ends[(t, p)]}, next {positions[(t, p)]}" for t, p in back)
    if back and slicing.offsets_went_back == "restart":
        positions = {**positions, **{tp: firsts[tp] for tp in back}}
        context.log.warning(f"offsets went back: {went_back}; read again from their first offsets")
        went_back = ""
    elif back:
        went_back = (f"offsets went back: {went_back}. The topic was deleted and created again, or the bootstrap "
                     "servers name another cluster; records below the next offset are not read (docs/slices.md)")
        context.log.error(went_back)
    new = plan_slices(positions, ends, policy=slicing.policy(), next_seq=latest + 1,
                      last_closed_at=closed_at, now=int(time.time() * 1000))
    for manifest in new:
        store.write(manifest)
    if new:
        positions, closed_at = new[-1].positions(), new[-1].closed_at
    last = new[-1].seq if new else latest
    requested = {m.seq: m.run_key for m in new}
    if cursor_seq + 1 < (new[0].seq if new else last + 1):
        requested.update(_catching_up(context, store, engine, range(cursor_seq + 1, last + 1), requested))
    keys = [slice_key(seq) for seq in sorted(requested)]
    cursor = dump_cursor(last, positions, closed_at)
    if not keys:
        pending = sum(max(0, ends[tp] - positions.get(tp, 0)) for tp in ends)
        return SensorResult(skip_reason=SkipReason(f"no slice closed ({pending} messages pending)"
                                                    + (f"; {went_back}" if went_back else "")), cursor=cursor)
    context.log.info(f"requesting slices {keys[0]}..{keys[-1]}")
    return SensorResult(
        run_requests=[RunRequest(run_key=requested[seq], partition_key=slice_key(seq)) for seq in sorted(requested)],
        dynamic_partitions_requests=[slices_partitions.build_add_request(keys)],
        cursor=cursor,
    )


def _catching_up(context, store: ManifestStore, engine, seqs: Iterable[int], closing: dict[int, str]) -> dict[int, str]:
    """Run keys of the slices past the cursor that this tick did not close (a lost cursor, slices
    closed by `entity-assets run`, a restored lake), but for those done (`slices_done`).

    A slice whose run succeeded but that a restored lake lacks gets a run key of this tick: the
    daemon skips a run key it has seen. The others keep theirs, so that a run already queued
    or started is not requested twice."""
    closed = store.closed_at()
    seqs = [seq for seq in seqs if seq not in closing]
    holds = lake_holds(engine)
    succeeded = slices_succeeded(context.instance, closed)
    now = int(time.time() * 1000)
    out = {}
    for seq in seqs:
        if seq in succeeded and seq <= holds:
            continue
        key = run_key(slice_key(seq), closed[seq])
        out[seq] = f"{key}~{now}" if seq in succeeded else key
    if len(out) < len(seqs):
        context.log.info(f"{len(seqs) - len(out)} slice(s) past the cursor ran already: not requested again")
    return out


def lake_holds(engine) -> int:
    """The last slice every state table of the lake holds (0: none)."""
    from entity_assets.assets.common import STATE_APP

    applied = [engine.applied(t, STATE_APP) or 0 for t in APPLIED_IN_ORDER if engine.exists(t)]
    return min(applied, default=0)


def slices_succeeded(instance: DagsterInstance, closed_at: dict[int, int]) -> set[int]:
    """The slices whose newest `slice_job` run succeeded and started after the slice closed.

    A run of a slice key before that ran other offsets: a lake restored behind its runs closes
    those slices again. A run without a start time (an instance without run stats) counts.
    Reads partition and time columns only: no run record is deserialized, however long the history.
    """
    out = set()
    for d in instance.get_run_partition_data(RunsFilter(job_name="slice_job", statuses=[DagsterRunStatus.SUCCESS])):
        seq = int(d.partition) if d.partition.isdigit() else None
        started = d.start_time or d.end_time
        if seq in closed_at and (started is None or started * 1000 >= closed_at[seq]):
            out.add(seq)
    return out
