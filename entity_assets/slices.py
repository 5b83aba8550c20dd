"""Slices: how Kafka offsets become Dagster partitions (pure, no Dagster, no Kafka).

A slice is a set of half-open offset ranges [start, end), one per topic-partition of the
input topics, with a monotonic sequence number. Its manifest lists every topic-partition,
including empty ranges, so the newest manifest alone says where the next slice starts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pyarrow as pa

KEY_WIDTH = 10

TopicPartition = tuple[str, int]


def slice_key(seq: int) -> str:
    """Zero-padded so keys sort in slice order in the UI and in storage."""
    return f"{seq:0{KEY_WIDTH}d}"


def run_key(key: str, closed_at: int) -> str:
    """A slice's run key. A lake restored behind the sensor closes its next slices again, under
    slice keys that runs already used: `closed_at` makes those new slices new runs."""
    return f"{key}@{closed_at}"


def slice_seq(key: str) -> int:
    """Only a key `slice_key` gives: a partition added by hand as `5` would read slice 5's
    manifest while every table holds its rows under `0000000005`."""
    if not (key.isascii() and key.isdigit() and slice_key(int(key)) == key):
        raise ValueError(f"not a slice key: {key!r} (the slices' keys are {KEY_WIDTH} digits, e.g. {slice_key(5)})")
    return int(key)


@dataclass(frozen=True, order=True)
class OffsetRange:
    topic: str
    partition: int
    start: int
    end: int  # exclusive

    @property
    def count(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Manifest:
    seq: int
    ranges: tuple[OffsetRange, ...]
    closed_at: int  # epoch ms when the sensor closed the slice; recorded once, reused by every re-run

    @property
    def key(self) -> str:
        return slice_key(self.seq)

    @property
    def run_key(self) -> str:
        return run_key(self.key, self.closed_at)

    @property
    def messages(self) -> int:
        return sum(r.count for r in self.ranges)

    def positions(self) -> dict[TopicPartition, int]:
        """Where the next slice starts."""
        return {(r.topic, r.partition): r.end for r in self.ranges}


MANIFEST_SCHEMA = pa.schema(
    [
        ("slice", pa.string()),
        ("seq", pa.int64()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("start_offset", pa.int64()),
        ("end_offset", pa.int64()),
        ("closed_at", pa.int64()),
    ]
)


def manifest_to_arrow(manifest: Manifest) -> pa.Table:
    rs = sorted(manifest.ranges)
    return pa.table(
        {
            "slice": [manifest.key] * len(rs),
            "seq": [manifest.seq] * len(rs),
            "topic": [r.topic for r in rs],
            "partition": [r.partition for r in rs],
            "start_offset": [r.start for r in rs],
            "end_offset": [r.end for r in rs],
            "closed_at": [manifest.closed_at] * len(rs),
        },
        schema=MANIFEST_SCHEMA,
    )


def manifests_from_arrow(table: pa.Table) -> dict[int, Manifest]:
    by_seq: dict[int, list[dict]] = {}
    for row in table.to_pylist():
        by_seq.setdefault(row["seq"], []).append(row)
    return {
        seq: Manifest(
            seq,
            tuple(sorted(OffsetRange(r["topic"], r["partition"], r["start_offset"], r["end_offset"]) for r in rows)),
            rows[0]["closed_at"],
        )
        for seq, rows in by_seq.items()
    }


@dataclass(frozen=True)
class SlicePolicy:
    """When to close a slice: bounds the partition count and the size of one run.

    At the default 15-minute interval a year of steady traffic makes about 35k slices, far
    under Dagster's recommended 100k partitions per asset.
    """

    min_interval_seconds: float = 900.0
    max_messages: int = 5_000_000


def plan_slices(
    positions: Mapping[TopicPartition, int],
    ends: Mapping[TopicPartition, int],
    *,
    policy: SlicePolicy,
    next_seq: int,
    last_closed_at: int | None,
    now: int,
    firsts: Mapping[TopicPartition, int] | None = None,
) -> list[Manifest]:
    """Closes zero or more slices covering [positions, ends).

    Nothing closes before `min_interval_seconds` since the last slice unless a full slice
    (`max_messages`) is waiting. A backlog over `max_messages` becomes several slices, each
    taking a proportional share of every partition's backlog. `firsts`: the first offset Kafka
    holds of each partition; offsets below it are gone, a dead letter to write and no message to
    read, so the first slice takes them and counts none of them (a stop past the retention made
    slices of nothing but dead letters).
    """
    current = {tp: positions.get(tp, 0) for tp in ends}
    live = {tp: max(current[tp], min((firsts or {}).get(tp, 0), ends[tp])) for tp in ends}
    backlog = {tp: max(0, ends[tp] - live[tp]) for tp in ends}
    pending = sum(backlog.values())

    def gone() -> bool:  # spans gone before the offsets a slice reads from: the next slice takes them
        return any(live[tp] > current[tp] for tp in ends)

    if pending == 0 and not gone():
        return []
    due = last_closed_at is None or (now - last_closed_at) >= policy.min_interval_seconds * 1000
    if not due and pending < policy.max_messages:
        return []
    slices: list[Manifest] = []
    seq = next_seq
    while pending >= policy.max_messages or (due and (pending > 0 or gone())):
        budget = policy.max_messages
        share = min(1.0, budget / pending) if pending else 1.0
        ranges = []
        for tp in sorted(current):
            take = min(backlog[tp], math.ceil(backlog[tp] * share), budget)
            budget -= take
            ranges.append(OffsetRange(tp[0], tp[1], current[tp], live[tp] + take))
            current[tp] = live[tp] = live[tp] + take
            backlog[tp] -= take
        pending = sum(backlog.values())
        slices.append(Manifest(seq, tuple(ranges), now))
        seq += 1
    return slices


def behind(positions: Mapping[TopicPartition, int], ends: Mapping[TopicPartition, int]) -> list[TopicPartition]:
    """Partitions whose end offset is below the next offset the slices read from: the topic was
    deleted and created again, or the bootstrap servers name another cluster. Their new records
    below that offset would never be read, so the sensor says so at every tick."""
    return sorted(tp for tp, end in ends.items() if end < positions.get(tp, 0))


def read_to(done: Mapping[TopicPartition, int], marks: Mapping[TopicPartition, tuple[int, int]]) -> dict[TopicPartition, int]:
    """How far the lake's state has read each partition of `marks` (first offset held, high
    watermark): `done`, the positions after the last slice done. A partition no slice has read,
    one whose records past `done` Kafka deleted, and one behind it (the topic created again: all
    its records are unread) count from their first offset held. Its lag is the high watermark less this."""
    out = {}
    for tp, (low, high) in marks.items():
        position = done.get(tp, low)
        out[tp] = position if low <= position <= high else low
    return out


def split_ranges(ranges: Iterable[OffsetRange], max_per_task: int,
                 firsts: Mapping[TopicPartition, int] | None = None) -> list[OffsetRange]:
    """Cuts ranges into task-sized pieces so that one hot partition still uses every core.
    `firsts`: the first offset Kafka holds of a partition; the offsets below it are one piece
    whatever its size, a dead letter to write (`plan_slices` gives such a span to one slice)."""
    out = []
    for r in ranges:
        start = r.start
        if (first := min((firsts or {}).get((r.topic, r.partition), start), r.end)) > start:
            out.append(OffsetRange(r.topic, r.partition, start, first))
            start = first
        while start < r.end:
            end = min(r.end, start + max_per_task)
            out.append(OffsetRange(r.topic, r.partition, start, end))
            start = end
    return out
