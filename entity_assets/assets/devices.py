"""Devices: who connects with which device and app version."""

from functools import partial

import pyarrow.compute as pc
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from entity_assets import fold
from entity_assets.assets.common import (
    collect_files,
    commit_state,
    ensure_tables,
    read_df,
    state_as_of,
    table_metadata,
)
from entity_assets.partitions import slices_partitions
from resources import LakeResource, SparkResource

DEVICE_KEY = ("dbid", "user", "device")


@asset(
    partitions_def=slices_partitions,
    deps=["connections"],
    group_name="devices",
    kinds={"spark", "delta"},
    description="State: per user the devices seen, first and last seen, the latest app version and client.",
)
def devices(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource) -> MaterializeResult:
    """The seed's reason for the connections stream: which app versions are in use."""
    from pyspark.sql import functions as F

    engine, key = lake.open(), context.partition_key
    ensure_tables(engine, ["devices"])
    apply, version, prior_files = state_as_of(engine, "devices", key)
    connections = engine.slice_files("connections", [key])
    summary = {"rows": 0, "files": 0, "version": engine.version("devices")}
    if not sum(f.rows for f in connections):
        # most slices carry no connections: the state stays as it is, recorded, with no Spark job
        if apply:
            summary["version"] = commit_state(engine, "devices", key, [], [])
        return _materialized(engine, summary, _app_versions(engine, version), 0, apply)
    session = spark.session()
    prior = read_df(session, prior_files, "devices")
    seen = read_df(session, connections, "connections").select(
        *DEVICE_KEY, "clientid", "appVersion", F.col("begun").alias("firstSeen"), F.col("begun").alias("lastSeen"),
        F.lit(1).cast("long").alias("connections"))
    latest = F.struct("lastSeen", "appVersion", "clientid")
    merged = (
        prior.drop("slice").unionByName(seen)
        .groupBy(*DEVICE_KEY)
        .agg(F.min("firstSeen").alias("firstSeen"), F.max("lastSeen").alias("lastSeen"),
             F.max(latest).alias("latest"), F.sum("connections").alias("connections"))
        .select(F.lit(key).alias("slice"), *DEVICE_KEY, "latest.clientid", "latest.appVersion", "firstSeen",
                "lastSeen", "connections")
    )
    if apply:
        fn = partial(fold.copy_task, target="devices", slice_key=key, uris={"devices": engine.uri("devices")},
                     storage_options=engine.storage_options)
        files = collect_files(merged.mapInArrow(fn, fold.FILES_DDL)).get("devices", [])
        summary.update(files=len(files), version=commit_state(engine, "devices", key, files, prior_files))
        # the new state's one column, read by the driver: no second pass over the merge
        app_versions = _app_versions(engine, summary["version"])
    else:  # a replay leaves the state as it is: the counts come from the merge it would write
        app_versions = {r["appVersion"]: r["count"] for r in merged.groupBy("appVersion").count().collect()}
    return _materialized(engine, summary, app_versions, sum(f.rows for f in connections), apply)


def _app_versions(engine, version: int | None) -> dict:
    counts = pc.value_counts(engine.read("devices", version, ["appVersion"]).column("appVersion"))
    return {v["values"]: v["counts"] for v in counts.to_pylist()}


def _materialized(engine, summary: dict, app_versions: dict, connections: int, apply: bool) -> MaterializeResult:
    summary["rows"] = sum(app_versions.values())
    meta = table_metadata(engine, "devices", summary)
    meta.update(app_versions=MetadataValue.json(dict(sorted(app_versions.items(), key=lambda kv: str(kv[0])))),
                connections_this_slice=MetadataValue.int(connections), replayed=MetadataValue.bool(not apply))
    return MaterializeResult(metadata=meta)
