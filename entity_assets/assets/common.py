"""Helpers shared by the slice assets: running task functions on Spark, committing their files."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from dagster import MetadataValue

from entity_assets.storage import DataFile, DeltaRsEngine
from entity_assets.tables import SCHEMAS


def ensure_tables(engine: DeltaRsEngine, tables: Iterable[str]) -> None:
    for table in tables:
        engine.ensure(table, SCHEMAS[table])


def run_tasks(spark, tasks: list[dict], fn: Callable) -> dict[str, list[DataFile]]:
    """Runs `fn` over `tasks` on the executors, one Spark task each; returns the files by table.

    Only file records come back to the driver, never rows.
    """
    if not tasks:
        return {}
    rdd = spark.sparkContext.parallelize(tasks, len(tasks)).mapPartitions(fn)
    by_table: dict[str, list[DataFile]] = defaultdict(list)
    for d in rdd.collect():
        by_table[d["table"]].append(DataFile(**d))
    return by_table


def commit_slice(engine: DeltaRsEngine, tables: Iterable[str], files: dict[str, list[DataFile]], slice_key: str) -> dict[str, dict]:
    """Replaces the slice in each table; returns rows and Delta version per table."""
    out = {}
    for table in tables:
        written = files.get(table, [])
        version = engine.replace_slice(table, SCHEMAS[table], written, slice_key)
        out[table] = {"rows": sum(f.rows for f in written), "files": len(written), "version": version}
    return out


def table_metadata(engine: DeltaRsEngine, table: str, summary: dict) -> dict:
    return {
        "rows": MetadataValue.int(summary["rows"]),
        "delta_version": MetadataValue.int(summary["version"]),
        "table_uri": MetadataValue.path(engine.uri(table)),
    }
