"""Devices: who connects with which device and app version."""

import json
from collections import Counter

import pyarrow.compute as pc
from dagster import AssetCheckSpec, AssetExecutionContext, MaterializeResult, MetadataValue, asset

from entity_assets import fold
from entity_assets.assets.common import (LAKE_KINDS, STATE_APP, ensure_tables, fold_buckets, one_row_per_key,
                                         require_inputs, slice_of, table_metadata)
from entity_assets.assets.retries import retried_when_transient
from entity_assets.notify import DEVICE_KEY
from entity_assets.partitions import LAKE_POOL, slices_partitions
from resources import LakeResource, SparkResource

APP_VERSIONS = "app_versions"
"""Metadata of each devices state commit: the app-version counts of the state it makes (JSON)."""


@asset(
    partitions_def=slices_partitions, pool=LAKE_POOL,
    deps=["connections"],
    group_name="devices",
    kinds=LAKE_KINDS,
    description="State: per user the devices seen, first and last seen, the latest app version and client; "
                "its metadata counts devices per app version, the seed's reason for the connections stream.",
    check_specs=[AssetCheckSpec("one_row_per_device", asset="devices", description="no (dbid, user, device) appears twice")],
)
@retried_when_transient
def devices(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource) -> MaterializeResult:
    """The seed's reason for the connections stream: which app versions are in use.

    A bucketed state like entities: a slice rewrites only the files of the devices it saw.
    """
    engine, key = lake.open(snapshot=True), slice_of(context)
    ensure_tables(engine, key, ["devices"], reads=["connections"])
    require_inputs(engine, key, ("connections",), "devices")
    connections = engine.slice_files("connections", [key])
    # the app-version counts of the state the slice makes: the counts recorded by the slice
    # before it plus this slice's changes, recorded on the state commit (no read of the state)
    before = _app_versions_before(engine, key)

    def record(counts: Counter) -> dict[str, str]:
        after = Counter(before)
        after.update({name[len(fold.APP_VERSION):]: n for name, n in counts.items() if name.startswith(fold.APP_VERSION)})
        return {APP_VERSIONS: json.dumps({v: n for v, n in sorted(after.items()) if n})}

    # most slices carry no connections: then no Spark job runs, and the state records the slice
    _, summary = fold_buckets(spark, {"connections": connections}, fold.connection_rows, fold.devices_task,
                              key_columns=DEVICE_KEY, order=DEVICE_KEY + ("begun",), engine=engine,
                              state_table="devices", slice_key=key, uris={"devices": engine.uri("devices")},
                              state_file_rows=lake.state_file_rows, metadata=record)
    app_versions = json.loads(summary["metadata"][APP_VERSIONS])
    summary["rows"] = sum(app_versions.values())
    meta = table_metadata(engine, "devices", summary)
    meta.update(app_versions=MetadataValue.json(app_versions),
                connections_this_slice=MetadataValue.int(sum(f.rows for f in connections)),
                replayed=MetadataValue.bool(summary["replayed"]))
    return MaterializeResult(metadata=meta, check_results=[
        one_row_per_key(engine, "devices", key, summary["counts"], summary, asset_key="devices",
                        check_name="one_row_per_device")])


def _app_versions_before(engine, slice_key: str) -> dict[str, int]:
    """The app-version counts of the state a slice folds over: those recorded on the commit that
    applied the slice before it, or, where that commit is not in the log (a lake written before
    counts were recorded, or a commit that lake_maintenance expired from the log), counted from
    that state's `appVersion` column."""
    from entity_assets.slices import slice_key as key_of, slice_seq

    seq = slice_seq(slice_key)
    if seq == 1:
        return {}
    commit = engine.commit_after("devices", key_of(seq - 1), "apply")
    if commit is None:
        if engine.applied("devices", STATE_APP) != seq - 1:
            return {}  # no state before, or a replay past the log: state_version refuses both, saying why
        version = None  # the latest version is the state the slice folds over
    elif APP_VERSIONS in commit:
        return json.loads(commit[APP_VERSIONS])
    else:
        version = commit["version"]
    counts = pc.value_counts(engine.read("devices", version, ["appVersion"]).column("appVersion"))
    return {v["values"]: v["counts"] for v in counts.to_pylist()}
