"""Shards: the files of one state bucket, each holding a range of key hashes.

A slice rewrites only the files that hold the keys it changed, so what a small slice rewrites
is bounded by its keys times the file size, whatever the size of the store. A shard holds the
keys whose 32-bit hash starts with its `prefix` (its first `depth` bits; depth 0 holds the whole
bucket); a file that would grow past its row bound is written as the two halves of its range,
and so on. The shard is in the file's name, so a Delta snapshot's file list gives a bucket's
shards without opening a file (files written before shards existed hold the whole bucket).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

BITS = 32
FILE_ROWS = 20_000
"""Default row bound of a state file (`LakeResource.state_file_rows`)."""
FILE_BYTES = 512 << 20
"""Bytes bound of a state file (its rows' Arrow bytes, and its new documents' text): 20,000
documents of 110 KB would pass the 2 GiB an Arrow column of text holds."""


class Shard(NamedTuple):
    depth: int
    prefix: int

    def halves(self) -> tuple[Shard, Shard]:
        return Shard(self.depth + 1, self.prefix << 1), Shard(self.depth + 1, self.prefix << 1 | 1)

    def ancestors(self) -> Iterator[Shard]:
        for depth in range(self.depth):
            yield Shard(depth, self.prefix >> (self.depth - depth))

    @property
    def tag(self) -> str:
        return f"shard{self.depth}x{self.prefix:08x}"


WHOLE = Shard(0, 0)
_TAG = re.compile(r"-shard(\d+)x([0-9a-f]{8})-")


def of_file(path: str) -> Shard:
    """The shard a state file holds, from its name."""
    m = _TAG.search(path.rsplit("/", 1)[-1])
    return Shard(int(m[1]), int(m[2], 16)) if m else WHOLE


def key_hash(key: str) -> int:
    """A stable 32-bit hash of a key string (`storage.key_string`), independent of the bucket's crc32."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big")


class ShardMap:
    """Which shard holds a hash, given the (disjoint) shards of a bucket's files."""

    def __init__(self, shards: Iterable[Shard]):
        self.shards = set(shards)
        self.depths = sorted({s.depth for s in self.shards})
        self.inner = {a for s in self.shards for a in s.ancestors()}

    def owner(self, h: int) -> Shard:
        """The file shard holding `h`; where none does (a new bucket), the largest shard free of files."""
        for depth in self.depths:
            s = Shard(depth, h >> (BITS - depth))
            if s in self.shards:
                return s
        depth = 0
        while (s := Shard(depth, h >> (BITS - depth))) in self.inner:
            depth += 1
        return s


def split(shard: Shard, hashes: Sequence[int], max_rows: int) -> Iterator[tuple[Shard, list[int]]]:
    """(shard, positions) of the rows of `shard` (their `hashes`), halving ranges until each holds at most `max_rows`."""
    pending = [(shard, list(range(len(hashes))))]
    while pending:
        s, rows = pending.pop()
        if len(rows) <= max_rows or s.depth == BITS:
            yield s, rows
            continue
        bit = BITS - s.depth - 1
        low, high = s.halves()
        pending.append((high, [i for i in rows if hashes[i] >> bit & 1]))
        pending.append((low, [i for i in rows if not hashes[i] >> bit & 1]))


def overlapping(shards: Iterable[Shard]) -> int:
    """How many of a bucket's files share keys with another file (must be 0)."""
    shards = list(shards)
    present = set(shards)
    return sum(1 for s in shards if any(a in present for a in s.ancestors())) + len(shards) - len(present)
