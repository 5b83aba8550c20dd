"""Durable slice manifests: the record every (re)materialization of a slice reads."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

from entity_assets.slices import MANIFEST_SCHEMA, Manifest, manifest_to_arrow, manifests_from_arrow, slice_key, slice_seq
from entity_assets.storage import DeltaRsEngine, read_tables

TABLE = "slice_manifests"
APP_ID = "entity-assets-sensor"


class MissingManifest(LookupError):
    pass


class ManifestStore:
    """Manifests live in a Delta table, one commit per slice, idempotent by sequence number."""

    def __init__(self, engine: DeltaRsEngine, *, reading: bool = False):
        """`reading`: the table exists, and its reader (`trace`) commits nothing to it, not even
        an older lake's property that `ensure` would add."""
        self.engine = engine
        if not reading:
            engine.ensure(TABLE, MANIFEST_SCHEMA)

    def latest_seq(self) -> int:
        return self.engine.applied(TABLE, APP_ID) or 0

    def get(self, key_or_seq: str | int) -> Manifest:
        seq = slice_seq(key_or_seq) if isinstance(key_or_seq, str) else key_or_seq
        found = manifests_from_arrow(self.engine.read(TABLE, where={"seq": seq}))
        if seq not in found:
            raise MissingManifest(f"slice {slice_key(seq)} has no manifest in {self.engine.uri(TABLE)}")
        return found[seq]

    def get_many(self, seqs: Iterable[int]) -> dict[int, Manifest]:
        """The manifests of `seqs` in one read: their files, picked by their statistics (a file per
        slice), or the table whole where a file holds several (compacted: a few files then)."""
        wanted = set(seqs)
        if not wanted:
            return {}
        files = self.engine.slice_files(TABLE, [slice_key(s) for s in wanted])
        found = manifests_from_arrow(pa.concat_tables(read_tables(files, self.engine.storage_options))) if files else {}
        if not wanted <= found.keys():
            found = manifests_from_arrow(self.engine.read(TABLE))
        if missing := sorted(wanted - found.keys()):
            raise MissingManifest(f"slice {slice_key(missing[0])} has no manifest in {self.engine.uri(TABLE)}")
        return {seq: found[seq] for seq in wanted}

    def latest(self) -> Manifest | None:
        seq = self.latest_seq()
        return self.get(seq) if seq else None

    def closed_at(self) -> dict[int, int]:
        """Seq -> when its slice closed (epoch ms), for every slice: from the log's statistics of
        its file (a file per slice), or from the files when some file lacks them."""
        stats = self.engine.file_stats(TABLE)
        if not stats.num_rows:
            return {}
        if {"min.seq", "max.seq", "min.closed_at"} <= set(stats.column_names):
            seqs, highs, closed = (stats[c].to_pylist() for c in ("min.seq", "max.seq", "min.closed_at"))
            if all(s is not None and s == h and c is not None for s, h, c in zip(seqs, highs, closed)):
                return dict(zip(seqs, closed))
        t = self.engine.read(TABLE, columns=["seq", "closed_at"])
        return dict(zip(t["seq"].to_pylist(), t["closed_at"].to_pylist()))

    def write(self, manifest: Manifest) -> None:
        if manifest.seq != self.latest_seq() + 1:
            raise ValueError(f"manifest {manifest.key} out of order: latest is {slice_key(self.latest_seq())}")
        self.engine.append_small(TABLE, manifest_to_arrow(manifest), slice_key=manifest.key,
                                 app_txn=(APP_ID, manifest.seq))
