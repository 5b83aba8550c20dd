"""Sample traffic: the seed's own messages and a reproducible generator of entity batches.

Records are (stream, key, value) with JSON values, ready for `kafka_io.produce`.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from entity_assets import qlik
from entity_assets.messages import request_key

Record = tuple[str, str, bytes]  # (stream, key, value)

SEED_CLIENT = "c297cf20-18bd-40e2-827d-9b563ca28ccd"

SEED_ENTITY_BATCH = {
    "db": "my-db", "clientid": SEED_CLIENT, "request": 2, "user": "jsmith", "begun": 1415747086227,
    "includeBefore": True, "includeAfter": True, "learning": True,
    "patches": [{
        "collection": "Contacts", "zone": "default", "entity": "400cb092-00af-4e44-bdcb-1a0c536692bf",
        "ops": [
            {"op": "add", "path": "firstName", "value": "Sally"},
            {"op": "add", "path": "lastName", "value": "Anderson"},
            {"op": "add", "path": "phone/home", "value": "1-222-555-1234"},
        ],
    }],
}


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


SEED_SCHEMA_PATCH = {
    "db": "my-db", "clientid": SEED_CLIENT, "request": 2, "user": "jsmith", "begun": 1415747089227,
    "part": 1, "parts": 1, "includeBefore": True, "includeAfter": True,
    "ops": [{"op": "add", "path": "Contacts/fields/firstName", "value": {"type": "STRING", "optional": False}}],
}

SEED_CONNECTION = {
    "db": "my-db", "clientid": SEED_CLIENT, "user": "jsmith", "device": "7980f77c-2529-4978-9281-c44297c0f57e",
    "appVersion": "1.1", "begun": 1415747103842,
}


def seed_records() -> list[Record]:
    """The seed's sample messages of the three input streams it defines."""
    b, p, c = SEED_ENTITY_BATCH, SEED_SCHEMA_PATCH, SEED_CONNECTION
    return [
        ("entity-batches", request_key(b["clientid"], b["request"]), encode(b)),
        ("schema-patches", p["db"], encode(p)),
        ("connections", c["user"], encode(c)),
    ]


# Bad records of the kinds clients send (malformed JSON, a missing field, a wrong type, an unknown op), so the demo shows their dead letters.
BAD_VALUES: list[tuple[str, bytes]] = [
    ("malformed JSON", b'{"clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd", "request": '),
    ("missing required field", encode({k: v for k, v in SEED_ENTITY_BATCH.items() if k != "user"})),
    ("wrong type", encode({**SEED_ENTITY_BATCH, "request": "two"})),
    ("malformed UUID", encode({**SEED_ENTITY_BATCH, "clientid": "not-a-uuid"})),
    ("unknown op", encode({**SEED_ENTITY_BATCH, "patches": [{**SEED_ENTITY_BATCH["patches"][0], "ops": [{"op": "upsert", "path": "a", "value": 1}]}]})),
]


@dataclass(frozen=True)
class BatchTraffic:
    """N patches over E entities, `ops` ops each; the first patch of an entity creates it."""

    patches: int = 1000
    entities: int = 100
    ops: int = 3
    patches_per_batch: int = 1
    clients: int = 8
    seed: int = 7
    dbid: str = "my-db"
    collections: tuple[str, ...] = ("Contacts", "Groups")
    zones: tuple[str, ...] = ("default", "A")
    learning: bool = False
    include_before: bool = False
    include_after: bool = True
    begun: int = 1415747086227

    def records(self) -> Iterator[Record]:
        rng = random.Random(self.seed)
        clients = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(self.clients)]
        targets = [
            (self.collections[i % len(self.collections)], self.zones[i % len(self.zones)],
             str(uuid.UUID(int=rng.getrandbits(128), version=4)))
            for i in range(self.entities)
        ]
        created = [False] * self.entities
        requests = [0] * self.clients
        made = 0
        while made < self.patches:
            c = rng.randrange(self.clients)
            requests[c] += 1
            patches = []
            for _ in range(min(self.patches_per_batch, self.patches - made)):
                i = made % self.entities if made < self.entities else rng.randrange(self.entities)
                collection, zone, entity = targets[i]
                patches.append({"collection": collection, "zone": zone, "entity": entity,
                                "ops": self._ops(rng, made, creating=not created[i])})
                created[i] = True
                made += 1
            batch = {
                "dbid": self.dbid, "clientid": clients[c], "request": requests[c], "user": f"user{c}",
                "begun": self.begun + made, "learning": self.learning,
                "includeBefore": self.include_before, "includeAfter": self.include_after, "patches": patches,
            }
            yield ("entity-batches", request_key(clients[c], requests[c]), encode(batch))

    def _ops(self, rng: random.Random, n: int, *, creating: bool) -> list[dict]:
        fields = [("firstName", f"First{n}"), ("lastName", f"Last{rng.randrange(1000)}"),
                  ("phone/home", f"1-222-555-{rng.randrange(10000):04d}"), ("age", rng.randrange(18, 90)),
                  ("active", rng.random() < 0.5)]
        ops = [{"op": "add", "path": p, "value": v} for p, v in fields[: self.ops]]
        if not creating and self.ops > 1:
            ops[0] = {"op": "replace", "path": fields[0][0], "value": fields[0][1]}
        return ops


SUBSCRIPTIONS = "$zoneSubscription"
ACK_ALL = 2**62
"""An `upTo` past any timestamp: acknowledges every notification of the device."""


@dataclass(frozen=True)
class GraphTraffic:
    """Traffic for the whole graph: declared schemas, connections, subscriptions, patches, acks.

    Device i belongs to user i % users and subscribes to zone i % zones; even devices to
    every action, odd ones to creations and deletions only (the seed's two-device example).
    Every third device acknowledges all its notifications (`acks`): an app acknowledges what it
    was sent, so these go after the slices that notified it, where they clear its inbox.
    """

    batches: BatchTraffic = BatchTraffic(learning=True)
    devices: int = 20
    users: int = 5
    app_versions: tuple[str, ...] = ("1.0", "1.1", "2.0")

    def subscriptions(self) -> Iterator[tuple[str, str, list[str]]]:
        """(device, subject zone, actions) of each device's subscription."""
        zones = self.batches.zones
        for i in range(self.devices):
            yield (f"device-{i:05d}", zones[i % len(zones)],
                   ["created", "updated", "deleted"] if i % 2 == 0 else ["created", "deleted"])

    def records(self) -> Iterator[Record]:
        yield from self.changes()
        yield from self.acks()

    def changes(self) -> Iterator[Record]:
        """Everything but the acks."""
        b = self.batches
        client = str(uuid.UUID(int=b.seed, version=4))
        fields = {"firstName": {"type": "STRING", "optional": False}, "lastName": {"type": "STRING", "optional": False}}
        for part, collection in enumerate(b.collections, start=1):
            patch = {"dbid": b.dbid, "clientid": client, "request": 1, "user": "admin", "begun": b.begun,
                     "part": part, "parts": len(b.collections), "includeAfter": True,
                     "ops": [{"op": "add", "path": f"{collection}/fields", "value": fields}]}
            yield ("schema-patches", b.dbid, encode(patch))
        subscriptions = []
        for i, (device, zone, actions) in enumerate(self.subscriptions()):
            user = f"user{i % self.users}"
            yield ("connections", user, encode({"dbid": b.dbid, "clientid": client, "user": user, "device": device,
                                                 "appVersion": self.app_versions[i % len(self.app_versions)],
                                                 "begun": b.begun + i}))
            subscriptions.append({"collection": SUBSCRIPTIONS, "zone": "default", "entity": f"sub-{device}",
                                  "ops": [{"op": "add", "path": "", "value": {
                                      "subjectZone": zone, "device": device, "user": user, "actions": actions}}]})
        # batches of 1,000 subscriptions stay under the seed's 1000 KB message limit
        for n, start in enumerate(range(0, len(subscriptions), 1000), start=2):
            batch = {"dbid": b.dbid, "clientid": client, "request": n, "user": "admin", "begun": b.begun,
                     "patches": subscriptions[start:start + 1000]}
            yield ("entity-batches", request_key(client, n), encode(batch))
        yield from b.records()

    def acks(self) -> Iterator[Record]:
        b = self.batches
        for i in range(0, self.devices, 3):
            device = f"device-{i:05d}"
            yield ("notification-acks", device, encode({"dbid": b.dbid, "user": f"user{i % self.users}",
                                                        "device": device, "upTo": ACK_ALL, "begun": b.begun}))


CDC_STREAMS = {"crm.customers.ingestion": "debezium", "erp.accounts.ingestion": "goldengate",
               "legacy.users.ingestion": "db2", "hr.employees.ingestion": "qlik"}
"""The sample's ingestion topics (under the topic prefix) and the format each one's connector writes."""

CDC_BAD = ("crm.customers.ingestion", encode({"ID": 0}), encode({"op": "t", "source": {"table": "CUSTOMERS"}}))
"""A Debezium truncate, which changes no row of a projection: a dead letter (GENERR002)."""


QLIK_SCHEMA_ID = "5a3c0d9e1f2b4c6d8e0f1a2b3c4d5e6f"
_QLIK_COLUMNS = {"ID": "long", "NAME": "string", "SCORE": "long"}


@dataclass(frozen=True)
class CdcTraffic:
    """Change data capture of four source systems (seeds 001 and 000), one projection each: every
    row is inserted, then changed `changes` times; every tenth row is deleted at the end. Qlik
    Replicate's metadata message comes after its first data messages, as when it is read from
    another partition."""

    rows: int = 100
    changes: int = 2
    seed: int = 7
    streams: tuple[str, ...] = tuple(CDC_STREAMS)

    def records(self) -> Iterator[Record]:
        for stream in self.streams:
            fmt = CDC_STREAMS[stream]
            rng = random.Random(f"{self.seed}/{stream}")
            rows = [{"ID": i, "NAME": f"Name{i}", "SCORE": rng.randrange(1000)} for i in range(self.rows)]
            made, metadata_after = 0, min(5, self.rows * (self.changes + 1))  # after some data, however few rows
            for version in range(self.changes + 1):
                for row in rows:
                    before = dict(row)
                    if version:
                        row["SCORE"] = rng.randrange(1000)
                    yield stream, *_cdc(fmt, row["ID"], before if version else None, dict(row))
                    made += 1
                    if fmt == "qlik" and made == metadata_after:
                        yield stream, "metadata", qlik.metadata_envelope(QLIK_SCHEMA_ID, "EMPLOYEES", _QLIK_COLUMNS,
                                                                         ["ID"])
            for row in rows[::10]:
                yield stream, *_cdc(fmt, row["ID"], row, None)


def _cdc(fmt: str, key: int, before: dict | None, after: dict | None) -> tuple[str | bytes, bytes | None]:
    """One record's (key, value) in a connector's format: a delete when `after` is None."""
    if fmt == "qlik":
        operation = "DELETE" if after is None else ("INSERT" if before is None else "UPDATE")
        return str(key), qlik.data_envelope(QLIK_SCHEMA_ID, qlik.data_schema("EMPLOYEES", _QLIK_COLUMNS), operation,
                                            after if after is not None else before, before)
    if fmt == "db2":
        return encode({"ID": key}), None if after is None else encode(after)
    if fmt == "goldengate":
        op_type = "D" if after is None else ("I" if before is None else "U")
        return str(key), encode({"op_type": op_type, "before": before, "after": after})
    op = "d" if after is None else ("c" if before is None else "u")
    return encode({"ID": key}), encode({"op": op, "before": before, "after": after, "source": {"connector": "sample"}})
