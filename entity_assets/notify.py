"""Devices, zone subscriptions, change fan-out and device inboxes (seed 004: connections,
zone-changes, changes-by-device, device-notifications).

Pure Python on purpose (stdlib + the pydantic models of ``messages``): the Dagster assets and the
Spark jobs call these functions per row, and the tests exercise the rules without a JVM.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import uuid
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from entity_assets.messages import ZoneSubscription, covers

__all__ = [
    "SUBSCRIPTIONS",
    "NOTIFICATION_NAMESPACE",
    "subject_zones",
    "parse_subscription",
    "read_subscription",
    "notification_id",
    "SubscriptionIndex",
    "recipients",
    "RECIPIENT_INPUTS",
    "DeviceInbox",
    "MAX_PENDING",
    "DEVICE_KEY",
    "seen",
]

SUBSCRIPTIONS = "$zoneSubscription"
"""The built-in collection whose entities are zone subscriptions (one per database)."""

NOTIFICATION_NAMESPACE = uuid.UUID("99fb1246-4957-4343-9e87-e2a28809f337")
"""Fixed uuid5 namespace of notification ids; never change it, or re-runs mint new ids."""
_NAMESPACE_BYTES = NOTIFICATION_NAMESPACE.bytes
_json_string = json.encoder.encode_basestring_ascii  # what json.dumps writes for a str


def parse_subscription(document: dict[str, Any] | None) -> ZoneSubscription | None:
    """The subscription a ``$zoneSubscription`` document describes, or None if it is not one.

    Never raises: a malformed subscription is user data, and must not stop a slice.
    """
    return read_subscription(document)[0]


def read_subscription(document) -> tuple[ZoneSubscription | None, str | None]:
    """The subscription a ``$zoneSubscription`` document describes, or why it describes none."""
    if not isinstance(document, dict):
        return None, "the document is not an object"
    try:
        return ZoneSubscription.model_validate(document), None
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        return None, f"{'.'.join(map(str, first['loc'])) or 'document'}: {first['msg']}"
    except (ValueError, TypeError) as exc:
        return None, str(exc)


def subject_zones(collection: str, zone: str, after: dict[str, Any] | None,
                  before: dict[str, Any] | None = None) -> tuple[str, str | None]:
    """The zone-changes partition of a change (a subscription's ``subjectZone``, else ``zone``),
    and the zone a subscription moved away from (None if it did not move).

    A subscription's change lands in the zone it watches after the change, or, when it is deleted
    or no longer a subscription, in the zone it watched before, so that zone's partition sees it
    go. With neither, the entity's own zone (there is no subject zone to honour). A subscription
    moved from zone A to B lands in both: on a compacted topic, A's partition would otherwise
    keep the subscription's last message there, watching A, for good.
    """
    if collection != SUBSCRIPTIONS:
        return zone, None
    now, was = parse_subscription(after), parse_subscription(before)
    if now is not None:
        return now.subjectZone, was.subjectZone if was is not None and was.subjectZone != now.subjectZone else None
    return (was.subjectZone if was is not None else zone), None


def notification_id(
    device: str,
    dbid: str,
    collection: str,
    zone: str,
    entity: str,
    clientid: str,
    request: int,
    part: int,
) -> str:
    """Deterministic id of one device's notification of one applied patch.

    (clientid, request, part) identifies the patch, so a re-run of a slice yields the same ids and
    an app's acks stay valid. The fields are JSON-encoded so no separator can make two keys collide.
    """
    # Byte for byte str(uuid5(NOTIFICATION_NAMESPACE, json.dumps([...]))), the ids of earlier
    # releases, at a third of the cost (one notification per device per change adds up).
    key = "[" + ", ".join([*map(_json_string, (device, dbid, collection, zone, entity, clientid)),
                           str(int(request)), str(int(part))]) + "]"
    h = bytearray(hashlib.sha1(_NAMESPACE_BYTES + key.encode()).digest()[:16])
    h[6], h[8] = (h[6] & 0x0F) | 0x50, (h[8] & 0x3F) | 0x80  # version 5, RFC 4122 variant
    x = h.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


class SubscriptionIndex:
    """Subscriptions in effect, indexed by (dbid, subjectZone).

    Built from (dbid, zone, entity, subscription): a subscription entity's key (entity ids are
    unique within a zone, not a database) and what it describes. A later one with the same key
    replaces the earlier, so a stream of successive versions can be fed in.

    Built once on the driver and sent to every fan-out task: it keeps each subscription as a
    tuple, and each of the few distinct (subjectCollection, actions) once: for 200,000
    subscriptions, a 7 MB pickle that a task loads in 0.4 s, where the models took 22 MB, 2.2 s
    and an index built again by every task.
    """

    def __init__(self, subscriptions: Iterable[tuple[str, str, str, ZoneSubscription]]) -> None:
        by_entity: dict[tuple[str, str, str], ZoneSubscription] = {}
        for dbid, zone, entity, sub in subscriptions:
            by_entity[(dbid, zone, entity)] = sub
        scopes: dict[tuple[str | None, frozenset[str]], tuple[str | None, frozenset[str]]] = {}
        self._by_zone: dict[tuple[str, str], list[tuple[str, str, tuple[str | None, frozenset[str]]]]] = {}
        for (dbid, _zone, _entity), sub in by_entity.items():
            scope = (sub.subjectCollection, frozenset(sub.actions))
            self._by_zone.setdefault((dbid, sub.subjectZone), []).append(
                (sub.device, sub.user, scopes.setdefault(scope, scope)))
        self._size = len(by_entity)
        self._devices: dict[tuple[str, str, str, str], list[tuple[str, str]]] = {}

    def __len__(self) -> int:
        return self._size

    def devices_for(self, dbid: str, collection: str, zone: str, action: str) -> list[tuple[str, str]]:
        """Sorted unique (device, user) pairs to notify of ``action`` on ``collection`` in ``zone``.

        Kept per argument tuple: a slice's changes repeat a few zones, collections and actions.
        """
        key = (dbid, collection, zone, action)
        pairs = self._devices.get(key)
        if pairs is None:
            subs = self._by_zone.get((dbid, zone), ())
            pairs = self._devices[key] = sorted({(device, user) for device, user, (subject, actions) in subs
                                                 if covers(subject, actions, collection, action)})
        return pairs


RECIPIENT_INPUTS = ("dbid", "collection", "zone", "entity", "action", "status", "clientid", "request", "part")
"""The fields of an entity update that `recipients` takes, in its order."""


def recipients(index: SubscriptionIndex, dbid: str, collection: str, zone: str, entity: str, action: str,
               status: int, clientid: str, request: int, part: int) -> list[tuple[str, str, str]]:
    """(device, user, notification id) of each device to notify of one entity update: its
    changes-by-device rows are the update's fields with these.

    The device is the Kafka key and the notification id is per device, so a device subscribed
    under several users (a shared device token) gets one row, carrying the lowest user in sort
    order (deterministic across re-runs). Changes of ``$zoneSubscription`` entities notify nobody,
    and neither do failed updates (entity-updates should hold only status 1; this is a guard).
    """
    if collection == SUBSCRIPTIONS or status != 1:
        return []
    out: list[tuple[str, str, str]] = []
    seen: set[str] = set()
    for device, user in index.devices_for(dbid, collection, zone, action):  # sorted: a device's lowest user first
        if device not in seen:
            seen.add(device)
            out.append((device, user, notification_id(device, dbid, collection, zone, entity, clientid, request, part)))
    return out


MAX_PENDING = 1_000
"""Unacknowledged notifications an inbox keeps: past it the oldest expire, so a device that never
acks (an app uninstalled) costs a bounded row, about 53 bytes per notification (53 KB; a state
file of 20,000 such rows is 1 GB, and each notification to a full inbox re-reads its row). A
badge shows "999+" long before."""


class DeviceInbox:
    """The unacknowledged notifications of one device; state kept between slices as JSON.

    Ordering within a slice: the caller applies the device's acks first and then adds its new
    notifications, which the slice's acks were sent before (they are published after the slice
    closed): an ``upTo`` does not take a new notification that ended at or before it, from a
    partition or a client clock behind the others. An ack naming an id that is not pending
    (unknown, already acked, or not yet seen) is ignored; it is not remembered, so a later
    notification with that id stays pending until an ``upTo`` covers it.

    ``last`` is the highest ``ended`` ever added; it survives acks so that an emptied inbox still
    has a timestamp for the message's required ``begun``/``ended``.
    """

    def __init__(
        self,
        dbid: str,
        user: str,
        device: str,
        pending: dict[str, int] | None = None,
        *,
        last: int | None = None,
    ) -> None:
        self.dbid = dbid
        self.user = user
        self.device = device
        self.pending: dict[str, int] = dict(pending or {})
        top = max(self.pending.values(), default=None)
        self.last = top if last is None else (last if top is None else max(last, top))

    def add(self, notification: str, ended: int) -> bool:
        """Record a notification; re-adding a pending id keeps its first ``ended`` (idempotent).
        Whether it was not pending: an inbox that gets only ids it holds has not changed."""
        if notification in self.pending:
            return False
        self.pending[notification] = ended
        if self.last is None or ended > self.last:
            self.last = ended
        return True

    def ack(self, notifications: Iterable[str] | None = None, up_to: int | None = None) -> tuple[int, int]:
        """Remove the named notifications and every one with ``ended <= up_to``: how many went, and
        how many of the named were not pending (acknowledged before, expired, or never sent). An
        id is matched in any case: the ids are lowercase UUIDs, which some apps' UUID types give
        back in capitals (Swift's `uuidString`)."""
        removed = missed = 0
        for notification in dict.fromkeys(n.lower() for n in notifications or ()):  # an id named twice, once
            if self.pending.pop(notification, None) is not None:
                removed += 1
            else:
                missed += 1
        if up_to is not None:
            covered = [n for n, ended in self.pending.items() if ended <= up_to]
            for notification in covered:
                del self.pending[notification]
            removed += len(covered)
        return removed, missed

    def expire(self, limit: int) -> int:
        """Keeps the `limit` newest notifications (by ``ended``, then id); how many expired.

        Applied once per slice, after its acks, so the outcome does not depend on how the slice's
        events were batched.
        """
        over = len(self.pending) - limit
        if over <= 0:
            return 0
        for notification, _ in heapq.nsmallest(over, self.pending.items(), key=lambda item: (item[1], item[0])):
            del self.pending[notification]
        return over

    @property
    def count(self) -> int:
        return len(self.pending)

    @property
    def begun(self) -> int | None:
        """``ended`` of the oldest unacknowledged notification."""
        return min(self.pending.values(), default=None)

    @property
    def ended(self) -> int | None:
        """``ended`` of the newest unacknowledged notification."""
        return max(self.pending.values(), default=None)

    def to_json(self) -> str:
        return json.dumps(
            {
                "dbid": self.dbid,
                "user": self.user,
                "device": self.device,
                "pending": self.pending,
                "last": self.last,
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> DeviceInbox:
        raw = json.loads(text)
        pending = {str(k): int(v) for k, v in (raw.get("pending") or {}).items()}
        return cls(raw["dbid"], raw["user"], raw["device"], pending, last=raw.get("last"))

    def message(self) -> dict[str, Any]:
        """The device-notifications message (validates as ``messages.DeviceNotification``).

        An empty inbox still yields a message (count 0, so the push service can clear the badge);
        its ``begun``/``ended`` are both the last notification's ``ended`` (0 if there never was one).
        """
        if self.pending:
            begun, ended = self.begun, self.ended
        else:
            begun = ended = self.last or 0
        return {
            "dbid": self.dbid,
            "db": self.dbid,
            "user": self.user,
            "device": self.device,
            "count": self.count,
            "begun": begun,
            "ended": ended,
        }

    def __repr__(self) -> str:
        return f"DeviceInbox({self.dbid!r}, {self.user!r}, {self.device!r}, count={self.count})"


DEVICE_KEY = ("dbid", "user", "device")
"""Key of the devices state: a user's device in a database."""


def seen(device: dict[str, Any] | None, connection: dict[str, Any]) -> dict[str, Any]:
    """A device's state after one more connection (None: its first).

    The latest connection (by `begun`) gives the app version and client; ties go to the
    greater (appVersion, clientid), so the state does not depend on arrival order. Kafka
    delivers at least once: the newest connection again is not counted again.
    """
    begun = connection["begun"]
    if device is None:
        return {**{k: connection[k] for k in DEVICE_KEY}, "clientid": connection["clientid"],
                "appVersion": connection["appVersion"], "firstSeen": begun, "lastSeen": begun, "connections": 1}
    newest = (device["lastSeen"], device["appVersion"], device["clientid"])
    if (begun, connection["appVersion"], connection["clientid"]) == newest:
        return device  # its newest connection delivered again (a producer's retry): counted once
    latest = max(newest, (begun, connection["appVersion"], connection["clientid"]))
    return {**{k: device[k] for k in DEVICE_KEY}, "clientid": latest[2], "appVersion": latest[1],
            "firstSeen": min(device["firstSeen"], begun), "lastSeen": latest[0],
            "connections": device["connections"] + 1}
