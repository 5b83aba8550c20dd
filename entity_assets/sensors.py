"""The Kafka offsets sensor: closes slices from new offsets and requests one run per slice."""


import json
import time

from dagster import RunRequest, SensorEvaluationContext, SensorResult, SkipReason, sensor

from entity_assets.jobs import slice_job
from entity_assets.manifests import ManifestStore
from entity_assets.partitions import slices_partitions
from entity_assets.slices import behind, plan_slices
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
    exist past the cursor (a tick that wrote them and died, or slices closed by the CLI), the
    sensor resumes from the newest manifest and requests those slices again; run keys make
    that idempotent. A lake behind the cursor (restored from a backup) closes its next slices
    again: their run keys differ (`Manifest.run_key`), so they run. The tick reads the manifests as of its first look (`snapshot`): of two
    ticks closing the same slice at once, Delta refuses the second commit (same app transaction).
    """
    store = ManifestStore(lake.open(snapshot=True))
    cursor_seq, positions, closed_at = load_cursor(context.cursor)
    latest = store.latest_seq()
    if latest != cursor_seq:
        newest = store.get(latest) if latest else None
        positions = newest.positions() if newest else {}
        closed_at = newest.closed_at if newest else None
        if latest < cursor_seq:
            context.log.warning(f"cursor at slice {cursor_seq} but the lake has {latest}: resuming from the lake")
            cursor_seq = latest

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
    closed = {m.seq: m for m in new}
    requested = [closed.get(seq) or store.get(seq) for seq in range(cursor_seq + 1, last + 1)]
    cursor = dump_cursor(last, positions, closed_at)
    if not requested:
        pending = sum(max(0, ends[tp] - positions.get(tp, 0)) for tp in ends)
        return SensorResult(skip_reason=SkipReason(f"no slice closed ({pending} messages pending)"
                                                    + (f"; {went_back}" if went_back else "")), cursor=cursor)
    context.log.info(f"requesting slices {requested[0].key}..{requested[-1].key}")
    return SensorResult(
        run_requests=[RunRequest(run_key=m.run_key, partition_key=m.key) for m in requested],
        dynamic_partitions_requests=[slices_partitions.build_add_request([m.key for m in requested])],
        cursor=cursor,
    )
