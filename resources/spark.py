"""Spark: `local[*]` by default, any master URL, or a Spark Connect server (`sc://host:port`)."""

from __future__ import annotations

import os
import sys

from dagster import ConfigurableResource
from pydantic import Field, PrivateAttr

from resources.deployed import Deployed

DEFAULT_CONF = {
    "spark.sql.shuffle.partitions": "8",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.python.worker.reuse": "true",
}
LOCAL_CONF = {
    "spark.python.daemon.module": "entity_assets.spark_daemon",
    "spark.sql.sources.parallelPartitionDiscovery.threshold": "100000",
    "spark.ui.enabled": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
}
"""On a local master the workers run this venv, so they can start warm (entity_assets/spark_daemon.py);
and the driver lists the files of a read itself: over 32 files Spark would run a listing job of
up to 10,000 tasks on the same cores (1-1.5 s on a read of the 64 files of a 1M-entity state),
which pays only against an object store's latency. Its executors are in its JVM (or, on
`local-cluster`, on this host): nothing off the host needs its ports, so they listen on 127.0.0.1,
and the web UI (every interface's port 4040, open to anyone) is off."""


class SparkResource(Deployed, ConfigurableResource):
    """One SparkSession per run.

    The code location's runs use Dagster's in-process executor, so every asset step of a run shares
    this resource instance and the JVM starts once; the session is built on first use, so a
    run that needs no Spark pays nothing. Most slices of a sensor-driven deployment are that
    small: a Spark job costs ~0.2 s here and a session 7-11 s (or ~0.5 s on a Connect server),
    more than their work up to `driver_rows`.
    """

    master: str = Field(default="local[*]", description="local[*], spark://host:7077, yarn, or sc://host for Spark Connect")
    app_name: str = "entity-assets"
    conf: dict[str, str] = Field(default_factory=dict, description="extra Spark conf, over the defaults")
    driver_rows: int = Field(default=10_000, ge=0, description=(
        "work of up to this many rows (or messages) runs in the driver, without a Spark job; "
        "0: every step's work runs in Spark tasks"))

    _session = PrivateAttr(default=None)
    _parallelism = PrivateAttr(default=None)

    @property
    def remote(self) -> bool:
        return self.master.startswith("sc://")

    def session(self):
        if self._session is None:
            from pyspark.sql import SparkSession

            from entity_assets.spark_connect import connect

            # Python workers must run the interpreter that has this project's packages.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
            builder = connect(self.master) if self.remote else SparkSession.builder.master(self.master)
            builder = builder.appName(self.app_name)
            for key, value in self.settings().items():
                builder = builder.config(key, value)
            self._session = builder.getOrCreate()
        return self._session

    def settings(self) -> dict[str, str]:
        """The session's Spark settings. A Spark Connect session may set SQL settings only: the
        server's own conf holds the rest (entity_assets/spark_connect.py gives the project's)."""
        if self.remote:
            conf = {k: v for k, v in DEFAULT_CONF.items() if k.startswith("spark.sql.")}
        else:
            conf = {**DEFAULT_CONF, **(LOCAL_CONF if self.master.startswith("local") else {})}
        return {**conf, **self.conf}

    def on_driver(self, rows: int | None) -> bool:
        """Whether work of `rows` rows (None: unknown) runs in the driver."""
        return rows is not None and rows <= self.driver_rows

    def parallelism(self) -> int:
        if self._parallelism is None:
            session = self.session()
            if self.remote:  # no SparkContext on Spark Connect: the partitions of a default range
                from pyspark.sql import functions as F

                self._parallelism = session.range(4096).select(F.spark_partition_id()).distinct().count()
            else:
                self._parallelism = session.sparkContext.defaultParallelism
        return max(1, self._parallelism)
