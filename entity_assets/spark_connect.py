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

The server runs code with the pipeline's environment, so it serves only clients that present its
token: a new one at each start, in a file of its folder that only its user may read, which the
runs' sessions read (`authenticated`, `connect`). Its Python worker daemon imports the project's code once,
so it records which code that is (`code_fingerprint`): `spark start` restarts a server that
started on other code (an upgrade since), and a run's session refuses it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import sys
import uuid
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlsplit

from entity_assets.local_service import PROC, LocalService, PortInUse, write_file

DEFAULT_PORT = 15002
"""Spark Connect's own default port."""

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
SESSION_ID = str(uuid.uuid5(uuid.NAMESPACE_URL, "entity-assets:spark-connect-session"))
SESSION_TIMEOUT = "3650d"
"""The shared session must not expire between runs: the server refuses the id of a closed session."""
TOKEN_VARIABLE = "SPARK_CONNECT_AUTHENTICATE_TOKEN"
"""Where the server reads its token when its conf has none: `spark.connect.authenticate.token`
would put it on its command line, which every user of the host sees."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")
FOLDER_CONF = "spark.entity-assets.folder"
"""A setting of the server's that Spark keeps unread: its folder, on its command line, which tells
this home's server from another's on the same port."""


class Outdated(RuntimeError):
    """The local server started on other code than this process's: its workers would run the old."""


@functools.cache
def code_fingerprint() -> str:
    """The code the server's Python workers load (entity_assets/spark_daemon.py): the project's
    sources (its resources' too, which its assets import) and the pyspark, pyarrow and
    confluent-kafka they run on. Computed once per process, as each session
    compares the server's with it."""
    import entity_assets
    import resources

    versions = ", ".join(f"{name} {version(name)}" for name in ("pyspark", "pyarrow", "confluent-kafka"))
    digest = hashlib.sha256(versions.encode())
    for package in (Path(entity_assets.__file__).parent, Path(resources.__file__).parent):
        for source in sorted(package.rglob("*.py")):
            code = source.read_bytes()
            digest.update(f"\0{package.name}/{source.relative_to(package)}\0{len(code)}\0".encode() + code)
    return digest.hexdigest()


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
        """Over `localhost`: the one name over which pyspark's client sends a token without TLS."""
        return f"sc://localhost:{self.port}/;session_id={SESSION_ID}"

    @property
    def token_file(self) -> Path:
        return self.data_dir / "token"

    @property
    def folder_argument(self) -> str:
        return f"{FOLDER_CONF}={self.data_dir}"

    def of_this_folder(self, pid: int, arguments: list[str]) -> bool:
        """A server started by a release that did not name its folder is this folder's if its
        environment holds this folder's token (Linux's /proc; elsewhere it cannot be told)."""
        if f"{FOLDER_CONF}=" in " ".join(arguments):
            return super().of_this_folder(pid, arguments)
        try:
            environment = (PROC / str(pid) / "environ").read_bytes().split(b"\0")
            token = self.token_file.read_bytes()
        except OSError:
            return False
        return f"{TOKEN_VARIABLE}=".encode() + token in environment

    def command(self) -> list[str]:
        from resources.spark import DEFAULT_CONF, LOCAL_CONF

        home = _spark_home()
        jar = next((home / "jars").glob("spark-connect_*.jar"))
        conf = {**DEFAULT_CONF, **LOCAL_CONF, "spark.connect.grpc.binding.address": self.host,
                "spark.connect.grpc.binding.port": str(self.port), "spark.log.level": "WARN",
                "spark.connect.session.manager.defaultSessionTimeout": SESSION_TIMEOUT, **dict(self.conf)}
        return [str(home / "bin" / "spark-submit"), "--master", self.master, "--name", "entity-assets",
                *(arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}")),
                "--conf", self.folder_argument, "--class", SERVER_CLASS, str(jar)]

    def environment(self) -> dict[str, str]:
        # Python workers run this venv's interpreter, which has the project's task code.
        return {**os.environ, "SPARK_HOME": str(_spark_home()), "PYSPARK_PYTHON": sys.executable,
                TOKEN_VARIABLE: self.token_file.read_text()}

    def fingerprint(self) -> str:
        return code_fingerprint()

    def prepare(self) -> None:
        super().prepare()
        write_file(self.token_file, secrets.token_urlsafe(32))

    def ready(self) -> bool:
        return self.listening()


def authenticated(master: str) -> str:
    """The URL a client connects to `master` with: for the home's own server (a loopback host, the
    port it runs on) with its token, which `master` must not hold (the UI shows it), over `localhost`
    (`url`); any other as it is. Raises Outdated for a server started on other code than this process's."""
    from resources.lake import default_home

    try:
        url = urlsplit(master)
        server = LocalSparkConnect(Path(default_home()) / "spark", port=url.port or DEFAULT_PORT)
        pid = server.pid() if url.hostname in LOOPBACK else None
    except (ValueError, PortInUse):  # not a port, or the home's server runs on another
        return master
    if pid is None:
        return master
    if server.outdated():
        raise Outdated(f"the local Spark Connect server (pid {pid}, {server.data_dir}) started on other code than "
                       "this run's (an upgrade since), which its Python workers would run: restart it "
                       "(`entity-assets spark stop`, then `entity-assets spark start` or scripts/ui.sh)")
    return f"sc://localhost:{server.port}/{url.path.lstrip('/')};token={server.token_file.read_text()}"


def connect(master: str):
    """A SparkSession builder connected to `master`: the home's own server over 127.0.0.1 itself,
    with its token. Over `localhost`, gRPC tries ::1 first, where any user of the host may listen
    on the port our server holds on 127.0.0.1 only, and would be sent the token."""
    url = authenticated(master)
    if url == master:
        from pyspark.sql import SparkSession

        return SparkSession.builder.remote(master)
    from pyspark.sql.connect.client import DefaultChannelBuilder
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    class Loopback(DefaultChannelBuilder):
        @property
        def endpoint(self) -> str:
            return f"ipv4:127.0.0.1:{urlsplit(url).port}"

    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # as pyspark's builder sets it when it hands over to Connect's
    return RemoteSession.builder.channelBuilder(Loopback(url))
