"""A local Spark Connect server: one warm Spark for every run the daemon launches.

The daemon runs each slice in a process of its own. A slice small enough for the driver
(`SparkResource.driver_rows`) needs no Spark; a larger one would pay 7-11 s of JVM start for
a SparkSession of its own on every run. Runs that connect to this server
(`ENTITY_ASSETS_SPARK_MASTER` set to its `url`) get a session in well under a second, on a JVM
and Python workers that are already warm. `scripts/ui.sh` starts it; a cluster's Spark Connect
endpoint replaces it through the same setting.

Every run attaches to one server session (`SESSION_ID`, kept for the server's life): on Spark
4.2 each session gets a Python worker daemon of its own that outlives the session until the
server stops (SPARK-54055), so a session per run would leak one daemon (~150 MB) per run. Runs
hold no session state (no temp views, no artifacts; the same SQL settings), and the lake pool
runs them one at a time.
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from entity_assets.local_service import LocalService

DEFAULT_PORT = 15002
"""Spark Connect's own default port."""

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
SESSION_ID = str(uuid.uuid5(uuid.NAMESPACE_URL, "entity-assets:spark-connect-session"))
SESSION_TIMEOUT = "3650d"
"""The shared session must not expire between runs: the server refuses the id of a closed session."""


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


@dataclass(frozen=True)
class LocalSparkConnect(LocalService):
    port: int = DEFAULT_PORT
    master: str = "local[*]"
    conf: tuple[tuple[str, str], ...] = ()
    """Settings over the project's (ENTITY_ASSETS_SPARK_CONF): a Spark Connect session may set
    SQL settings only, so the server takes the others (memory, JVM options) at its start."""
    name, program = "spark-connect", SERVER_CLASS

    @property
    def url(self) -> str:
        return f"sc://{self.address}/;session_id={SESSION_ID}"

    def command(self) -> list[str]:
        from resources.spark import DEFAULT_CONF, LOCAL_CONF

        home = _spark_home()
        jar = next((home / "jars").glob("spark-connect_*.jar"))
        conf = {**DEFAULT_CONF, **LOCAL_CONF, "spark.connect.grpc.binding.address": self.host,
                "spark.connect.grpc.binding.port": str(self.port), "spark.ui.enabled": "false",
                "spark.connect.session.manager.defaultSessionTimeout": SESSION_TIMEOUT, **dict(self.conf)}
        return [str(home / "bin" / "spark-submit"), "--master", self.master, "--name", "entity-assets",
                *(arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}")),
                "--class", SERVER_CLASS, str(jar)]

    def environment(self) -> dict[str, str]:
        # Python workers run this venv's interpreter, which has the project's task code.
        return {**os.environ, "SPARK_HOME": str(_spark_home()), "PYSPARK_PYTHON": sys.executable}

    def ready(self) -> bool:
        return self.listening()
