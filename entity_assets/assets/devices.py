"""Devices: who connects with which device and app version."""

import pyarrow.compute as pc
from dagster import AssetCheckSpec, AssetExecutionContext, MaterializeResult, MetadataValue, asset

from entity_assets import fold
from entity_assets.assets.common import ensure_tables, fold_buckets, one_row_per_key, pop_counts, read_df, table_metadata
from entity_assets.core import STATE_BUCKETS
from entity_assets.notify import DEVICE_KEY
from entity_assets.partitions import slices_partitions
from resources import LakeResource, SparkResource


@asset(
    partitions_def=slices_partitions,
    deps=["connections"],
    group_name="devices",
    kinds={"spark", "delta"},
    description="State: per user the devices seen, first and last seen, the latest app version and client.",
    check_specs=[AssetCheckSpec("one_row_per_device", asset="devices", description="no (dbid, user, device) appears twice")],
)
def devices(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource) -> MaterializeResult:
    """The seed's reason for the connections stream: which app versions are in use.

    A bucketed state like entities: a slice rewrites only the files of the devices it saw.
    """
    from pyspark.sql import functions as F

    engine, key = lake.open(), context.partition_key
    ensure_tables(engine, ["devices"])
    connections = engine.slice_files("connections", [key])
    seen = read_df(spark.session(), connections, "connections").select(
        *DEVICE_KEY, "clientid", "appVersion", "begun",
        (F.crc32(F.concat_ws("\x1f", *DEVICE_KEY)) % STATE_BUCKETS).cast("int").alias("bucket"))
    # most slices carry no connections: then no Spark job runs, and the state records the slice
    files, summary = fold_buckets(spark, seen, DEVICE_KEY + ("begun",), fold.devices_task, engine=engine,
                              state_table="devices", slice_key=key, uris={"devices": engine.uri("devices")},
                              state_file_rows=lake.state_file_rows, rows=sum(f.rows for f in connections))
    # the state this slice made (a replay made the same): its one column, read by the driver
    made = engine.version_after("devices", key, "apply") if summary["replayed"] else summary["version"]
    counts = pc.value_counts(engine.read("devices", made, ["appVersion"]).column("appVersion"))
    app_versions = {v["values"]: v["counts"] for v in counts.to_pylist()}
    summary["rows"] = sum(app_versions.values())
    meta = table_metadata(engine, "devices", summary)
    meta.update(app_versions=MetadataValue.json(dict(sorted(app_versions.items(), key=lambda kv: str(kv[0])))),
                connections_this_slice=MetadataValue.int(sum(f.rows for f in connections)),
                replayed=MetadataValue.bool(summary["replayed"]))
    return MaterializeResult(metadata=meta, check_results=[
        one_row_per_key(engine, "devices", key, pop_counts(files), asset_key="devices", check_name="one_row_per_device")])
