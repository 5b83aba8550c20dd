"""Spark: `local[*]` by default, any master URL (or Spark Connect `sc://`) by configuration."""

from __future__ import annotations

import os
import sys

from dagster import ConfigurableResource
from pydantic import Field, PrivateAttr

DEFAULT_CONF = {
    "spark.sql.shuffle.partitions": "8",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.python.worker.reuse": "true",
}
LOCAL_CONF = {
    "spark.python.daemon.module": "entity_assets.spark_daemon",
    "spark.sql.sources.parallelPartitionDiscovery.threshold": "100000",
}
"""On a local master the workers run this venv, so they can start warm (entity_assets/spark_daemon.py);
and the driver lists the files of a read itself: over 32 files Spark would run a listing job of
up to 10,000 tasks on the same cores (1-1.5 s on a read of the 64 files of a 1M-entity state),
which pays only against an object store's latency."""


class SparkResource(ConfigurableResource):
    """One SparkSession per run.

    The code location's runs use Dagster's in-process executor, so every asset step of a run shares
    this resource instance and the JVM starts once; the session is built on first use, so a
    run that needs no Spark pays nothing.
    """

    master: str = Field(default="local[*]", description="local[*], spark://host:7077, yarn, or sc://host for Spark Connect")
    app_name: str = "entity-assets"
    conf: dict[str, str] = Field(default_factory=dict, description="extra Spark conf, over the defaults")

    _session = PrivateAttr(default=None)

    def session(self):
        if self._session is None:
            from pyspark.sql import SparkSession

            # Python workers must run the interpreter that has this project's packages.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
            builder = SparkSession.builder.appName(self.app_name)
            builder = builder.remote(self.master) if self.master.startswith("sc://") else builder.master(self.master)
            local = LOCAL_CONF if self.master.startswith("local") else {}
            for key, value in {**DEFAULT_CONF, **local, **self.conf}.items():
                builder = builder.config(key, value)
            self._session = builder.getOrCreate()
        return self._session

    def parallelism(self) -> int:
        return max(1, self.session().sparkContext.defaultParallelism)
