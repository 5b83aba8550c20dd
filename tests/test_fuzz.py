"""Bad input never crashes a run and never disappears: seeded mutations of every input stream.

Valid traffic of the four input streams (the seed's samples, declared schemas, connections,
subscriptions, patches, acks) is mutated record by record, in the bytes (truncation, a flipped
byte, invalid UTF-8, not JSON at all) and in the parsed message (a field removed, a field of
another type or out of range, an unknown field, a document nested past the limit, a broken
key), then runs through the whole graph in two slices. Every run must succeed, every record
must land exactly once, as a row of its input table or as a dead letter with a known code, a
reason and its original bytes, and the invariant asset checks must pass.
"""

from __future__ import annotations

import json
import random
from collections import Counter

from test_ingest import coordinates

from entity_assets import samples
from entity_assets.ingest import INPUT_STREAMS
from entity_assets.kafka_io import ensure_topics
from entity_assets.messages import DeadLetterCode

INVARIANTS = {"updates_are_successes", "responses_have_every_part", "one_row_per_entity", "one_row_per_database",
              "one_row_per_device", "one_inbox_per_device"}
"""Every asset check but `entities_match_declared_schema`, which reports what users sent."""

CODES = {c.value for c in DeadLetterCode} - {DeadLetterCode.UNEXPECTED.value}
"""What mutated input may be: GENERR009 is a bug of ours (an exception an adapter did not expect)."""

ODD_VALUES = [None, True, 0, -1, 2**63, -(2**63) - 1, 1.5, float("1e308"), "", "x" * 3000, "not-a-uuid", [], {},
              [1, "a", None], {"op": "add"}, "\u0000\ud7ff\U0001f600"]


def deep(levels: int):
    doc: object = "bottom"
    for _ in range(levels):
        doc = [doc]
    return doc


def _nodes(value, path=()):
    """Every (path, value) inside a parsed message, the message itself first."""
    yield path, value
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in children:
        yield from _nodes(v, (*path, k))


def _parent(doc, path):
    """The container holding the node at `path` (never the message itself)."""
    for k in path[:-1]:
        doc = doc[k]
    return doc


def mutate(rng: random.Random, key, value: bytes, *, json_value: bool = True):
    """One seeded mutation of a record: (key, value, the kind of mutation). Not `json_value` (Avro):
    only the mutations of bytes and keys."""
    kind = rng.randrange(12 if json_value else 5)
    if kind == 0:
        return key, value[: rng.randrange(len(value))], "truncated"
    if kind == 1:
        i = rng.randrange(len(value))
        return key, value[:i] + bytes([value[i] ^ (1 << rng.randrange(8))]) + value[i + 1:], "flipped a bit"
    if kind == 2:
        i = rng.randrange(len(value))
        return key, value[:i] + b"\xff\xfe" + value[i:], "invalid UTF-8"
    if kind == 3:
        return key, rng.choice([b"", b"null", b"[]", b"{}", b"42", b'"text"', b"not json"]), "not a message"
    if kind == 4:
        return rng.choice([None, b"", b"\xff" * 8, b"k" * 500]), value, "odd key"
    doc = json.loads(value)
    if kind == 11 and isinstance(doc, dict) and doc:  # the last value is the one a parser keeps
        name = json.dumps(rng.choice(list(doc))).encode()
        return key, value.rstrip()[:-1] + b", " + name + b": " + json.dumps(rng.choice(ODD_VALUES)).encode() + b"}", \
            "repeated a name"
    nodes = list(_nodes(doc))[1:]
    path, _ = rng.choice(nodes)
    if kind in (5, 6):
        del _parent(doc, path)[path[-1]]
        what = "removed a field"
    elif kind in (7, 8, 9):
        _parent(doc, path)[path[-1]] = rng.choice(ODD_VALUES)
        what = "odd value"
    elif rng.random() < 0.5:
        doc["unexpected"] = rng.choice(ODD_VALUES)
        what = "unknown field"
    else:
        _parent(doc, path)[path[-1]] = deep(150)
        what = "nested 150 deep"
    return key, json.dumps(doc).encode(), what


def test_mutated_records_of_every_input_stream_land_once_as_rows_or_dead_letters(pipeline):
    rng = random.Random(1124)
    graph = samples.GraphTraffic(samples.BatchTraffic(patches=300, entities=60, learning=True, seed=3), devices=12)
    records = samples.seed_records() + list(graph.records())
    mutations = Counter()
    mixed, intact = [], set()
    for stream, key, value in records:
        if rng.random() < 0.5:
            key, value, what = mutate(rng, key, value)
            mutations[what] += 1
        else:
            intact.add((stream, None if key is None else key.encode() if isinstance(key, str) else key, value))
        mixed.append((stream, key, value))
    assert len(mutations) == 10, mutations  # every kind of mutation

    for half in (mixed[: len(mixed) // 2], mixed[len(mixed) // 2:]):
        pipeline.produce(half)
        [request] = pipeline.tick()
        result = pipeline.run_request(request, raise_on_error=False)
        failures = [pipeline.failure_text(e) for e in result.all_events if e.is_step_failure]
        assert result.success, failures
        checks = {name: e.passed for name, e in pipeline.checks(result).items()}
        assert INVARIANTS <= checks.keys() and all(checks[name] for name in INVARIANTS), checks

    dead = pipeline.read("dead_letters")
    for row in dead.to_pylist():
        assert row["code"] in CODES and row["reason"], row
    dead_at = dict(zip(coordinates(dead), dead.to_pylist()))
    assert len(dead_at) == dead.num_rows
    unmutated = 0
    for stream, spec in INPUT_STREAMS.items():
        consumed = {(pipeline.topic(stream), r["partition"], r["offset"]): r for r in pipeline.consume(stream)}
        unmutated += sum((stream, r["key"], r["value"]) in intact for r in consumed.values())
        written = coordinates(pipeline.read(spec.table))
        dead_here = [c for c in dead_at if c[0] == pipeline.topic(stream)]
        assert len(set(written)) == len(written) and not set(written) & set(dead_here), stream
        assert set(written) | set(dead_here) == consumed.keys(), stream
        for c in dead_here:
            assert (dead_at[c]["value"], dead_at[c]["kafka_key"]) == (consumed[c]["value"], consumed[c]["key"]), c
            assert (stream, consumed[c]["key"], consumed[c]["value"]) not in intact, (c, dead_at[c]["reason"])
    assert dead.num_rows > len(records) // 5  # most mutations are bad input; some leave a valid message
    assert unmutated > len(records) // 3  # the records left intact were recognised (and none is a dead letter)

    # every patch that got through has its response
    patches = pipeline.read("entity_patches").num_rows
    responses = [r for r in pipeline.read("partial_responses").to_pylist() if r["stream"] == "entity-updates"]
    assert patches > 0 and len(responses) == patches


def test_mutated_cdc_records_land_once_as_rows_or_dead_letters(pipeline):
    """The same for the CDC ingestion topics of every format: each record is an entity batch, a
    Qlik schema registration or a dead letter, once, or a Qlik data message still waiting for its
    schema; one that waited is also, in the slice that brought its schema, an entity batch."""
    rng = random.Random(1125)
    ensure_topics(pipeline.kafka.config(), [pipeline.topic(s) for s in samples.CDC_STREAMS], 2)
    mixed, mutations = [], Counter()
    for stream, key, value in samples.CdcTraffic(rows=30, changes=1).records():
        if value and rng.random() < 0.5:
            key, value, what = mutate(rng, key, value, json_value=samples.CDC_STREAMS[stream] != "qlik")
            mutations[what] += 1
        mixed.append((stream, key, value))
    assert len(mutations) == 10, mutations

    for half in (mixed[: len(mixed) // 2], mixed[len(mixed) // 2:]):
        pipeline.produce(half)
        [request] = pipeline.tick()
        result = pipeline.run_request(request, raise_on_error=False)
        assert result.success, [pipeline.failure_text(e) for e in result.all_events if e.is_step_failure]
        checks = {name: e.passed for name, e in pipeline.checks(result).items()}
        assert all(checks[name] for name in INVARIANTS), checks

    dead = pipeline.read("dead_letters")
    assert all(r["code"] in CODES and r["reason"] and r["stream"] == "ingestion" for r in dead.to_pylist())
    dead_at = dict(zip(coordinates(dead), dead.to_pylist()))
    written = coordinates(pipeline.read("entity_batches")) + coordinates(pipeline.read("avro_schemas"))
    assert len(set(written)) == len(written) and len(dead_at) == dead.num_rows
    waited = set(coordinates(pipeline.read("schema_waits")))
    assert not set(written) & set(dead_at)
    consumed = {(pipeline.topic(s), r["partition"], r["offset"]) for s in samples.CDC_STREAMS
                for r in pipeline.consume(s)}
    assert set(written) | set(dead_at) | waited == consumed
    assert sum(mutations.values()) * 0.3 < dead.num_rows  # most mutations are bad input
