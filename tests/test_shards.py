"""Unit tests for entity_assets.shards (pure, milliseconds)."""

import random

from entity_assets.shards import BITS, WHOLE, Shard, ShardMap, key_hash, of_file, overlapping, split


def test_a_file_name_gives_its_shard_and_an_untagged_file_holds_the_whole_bucket():
    assert of_file(f"/lake/entities/part-0000000003-{Shard(3, 5).tag}-0f3a.parquet") == Shard(3, 5)
    assert of_file("part-0000000003-0f3a9c.parquet") == WHOLE
    assert Shard(3, 5).tag == "shard3x00000005"


def test_the_key_hash_is_stable_across_processes_and_releases():
    assert key_hash("2:db:8:Contacts:1:A:4:e-17") == key_hash("2:db:8:Contacts:1:A:4:e-17") == 879273682
    assert 0 <= key_hash("") < 2**BITS


def test_a_hash_belongs_to_the_file_shard_holding_it_or_to_the_largest_free_shard():
    top = 1 << (BITS - 1)
    assert ShardMap([]).owner(123) == WHOLE
    assert ShardMap([WHOLE]).owner(top + 5) == WHOLE
    halves = ShardMap([Shard(1, 0), Shard(2, 2), Shard(2, 3)])
    assert halves.owner(5) == Shard(1, 0)
    assert halves.owner(top + 5) == Shard(2, 2)
    assert halves.owner(top | top >> 1) == Shard(2, 3)
    # a range whose files are gone (a shard emptied): keys there start the largest free shard
    quarter = ShardMap([Shard(2, 0)])
    assert quarter.owner(top >> 1) == Shard(2, 1)
    assert quarter.owner(top) == Shard(1, 1)


def test_split_halves_ranges_until_every_part_fits():
    rng = random.Random(5)
    hashes = [rng.getrandbits(BITS) for _ in range(1000)]
    parts = list(split(Shard(1, 1), [h | 1 << (BITS - 1) for h in hashes], 100))
    positions = sorted(i for _, rows in parts for i in rows)
    assert positions == list(range(1000))
    for shard, rows in parts:
        assert len(rows) <= 100 and shard.depth >= 1
        assert all((hashes[i] | 1 << (BITS - 1)) >> (BITS - shard.depth) == shard.prefix for i in rows)
    assert overlapping(s for s, _ in parts) == 0
    assert list(split(WHOLE, hashes[:10], 10)) == [(WHOLE, list(range(10)))]


def test_overlapping_counts_files_sharing_keys_with_another():
    assert overlapping([Shard(1, 0), Shard(2, 2), Shard(2, 3)]) == 0
    assert overlapping([WHOLE, Shard(1, 1)]) == 1
    assert overlapping([Shard(1, 0), Shard(1, 0)]) == 1
