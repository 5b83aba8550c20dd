"""The pipeline on Spark Connect, as the daemon's runs use it (scripts/ui.sh): the same slices run
by two `entity-assets run` processes against a local Spark Connect server write the tables a
classic local session writes, and leave one pool of Python workers on the server; the server
serves only clients with its token, and a run refuses a server started on other code. The token's
test and the slow test start a Spark Connect server (a JVM) of their own."""

import gc
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from entity_assets import samples
from entity_assets.broker import LocalBroker
from entity_assets.local_service import NotReady, PortInUse, _arguments
from entity_assets.spark_connect import (SERVER_CLASS, SESSION_ID, SESSION_TIMEOUT, TOKEN_VARIABLE, LocalSparkConnect,
                                         Outdated, authenticated)
from resources import LakeResource, SparkResource

REPO = Path(__file__).resolve().parents[1]
# As the suite's pipelines do (conftest.make_pipeline): every step's work in Spark tasks, split
# over several, so the work really goes through the server.
RUN = ("import entity_assets.assets.common as c; c.SMALL_TASK_ROWS = 1; "
       "from entity_assets.cli import main; raise SystemExit(main(['run']))")


def test_the_local_server_serves_one_long_session_with_the_project_workers(tmp_path):
    server = LocalSparkConnect(tmp_path, port=15123)
    assert server.url == f"sc://localhost:15123/;session_id={SESSION_ID}"
    command = " ".join(server.command())
    assert "SparkConnectServer" in command and "spark-connect_" in command
    for setting in ("spark.connect.grpc.binding.port=15123", f"defaultSessionTimeout={SESSION_TIMEOUT}",
                    "spark.python.daemon.module=entity_assets.spark_daemon", "spark.log.level=WARN",
                    "spark.ui.enabled=false", "spark.driver.bindAddress=127.0.0.1", f"--conf {server.folder_argument}"):
        assert setting in command
    server.prepare()  # a new token at each start, in its environment, never on its command line
    token = server.token_file.read_text()
    assert server.environment()[TOKEN_VARIABLE] == token and token not in command and len(token) >= 32
    assert stat.S_IMODE(server.token_file.stat().st_mode) == 0o600
    server.prepare()
    assert server.token_file.read_text() != token
    assert server.environment()["PYSPARK_PYTHON"] == sys.executable
    # a session on it sets SQL settings only; the server holds the rest
    remote = SparkResource(master=server.url).settings()
    assert remote and all(k.startswith("spark.sql.") for k in remote)
    assert set(remote) < set(SparkResource(master="local[2]").settings())


def test_the_local_server_takes_the_environment_s_spark_settings(tmp_path, monkeypatch):
    """A Spark Connect session ignores what is not a SQL setting: `spark start` gives the server
    ENTITY_ASSETS_SPARK_CONF's, over the project's."""
    from entity_assets import cli

    started = []
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("ENTITY_ASSETS_SPARK_CONF", "spark.executor.memory=8g,spark.sql.shuffle.partitions=7")
    monkeypatch.setattr(LocalSparkConnect, "start", lambda self, timeout: started.append(self.command()) or 1)
    assert cli.main(["spark", "start"]) == 0
    command = " ".join(started[0])
    assert "--conf spark.executor.memory=8g" in command and "--conf spark.sql.shuffle.partitions=7" in command
    assert "spark.sql.shuffle.partitions=8" not in command  # the project's default, overridden


def test_a_server_does_not_start_on_a_port_another_process_holds(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as other:
        server = LocalSparkConnect(tmp_path, port=other.getsockname()[1])
        with pytest.raises(RuntimeError, match="in use"):
            server.start()
    assert server.pid() is None


def test_a_stale_pid_file_names_no_server_and_its_process_is_never_signalled(tmp_path):
    """After a reboot or a crash, the pid a file names may be another process's: `stop` must not end it."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        server = LocalBroker(tmp_path, port=29555)
        server.pid_file.write_text(str(other.pid))
        assert server.pid() is None and server.stop() is False
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_server_of_the_same_folder_on_another_port_is_named(running, tmp_path):
    """`--port 29093 broker start` beside the demo's broker on 29092: one data folder, two brokers."""
    broker = running("noida-db", "--data-dir", str(tmp_path / "data"), "--kafka-port", "29092")
    LocalBroker(tmp_path, port=29092).pid_file.write_text(str(broker.pid))
    assert LocalBroker(tmp_path, port=29092).pid() == broker.pid
    with pytest.raises(PortInUse, match="on another port than 29093"):
        LocalBroker(tmp_path, port=29093).pid()


def test_another_home_s_server_is_never_taken_for_this_one_s(running, tmp_path):
    """Two clones on the default ports: a stale pid file of one that names the other's server (a
    reboot since) made `broker stop` and `spark stop` end the other's."""
    ours, theirs = LocalBroker(tmp_path / "a", port=29092), LocalBroker(tmp_path / "ab", port=29092)
    broker = running("noida-db", "start", "--data-dir", theirs.folder_argument, "--kafka-port", "29092")
    ours.data_dir.mkdir()
    ours.pid_file.write_text(str(broker.pid))
    assert ours.pid() is None and ours.stop() is False and broker.poll() is None
    theirs.data_dir.mkdir()
    theirs.pid_file.write_text(str(broker.pid))
    assert theirs.pid() == broker.pid
    ours, theirs = LocalSparkConnect(tmp_path / "a", port=15124), LocalSparkConnect(tmp_path / "ab", port=15124)
    server = running(SERVER_CLASS, "--conf", theirs.folder_argument, "--conf", "spark.connect.grpc.binding.port=15124")
    ours.pid_file.write_text(str(server.pid))
    assert ours.pid() is None and ours.stop() is False and server.poll() is None
    theirs.pid_file.write_text(str(server.pid))
    assert theirs.pid() == server.pid
    # a home named through a symbolic link (the shell's logical $PWD, as the scripts export it) is the same home
    (tmp_path / "link").symlink_to(tmp_path / "ab")
    assert LocalSparkConnect(tmp_path / "link", port=15124).pid() == server.pid
    assert LocalBroker(tmp_path / "link", port=29092).pid() == broker.pid


def test_a_server_started_before_it_named_its_folder_is_this_one_s_if_it_holds_its_token(tmp_path):
    """A release before named no folder on the Spark server's command line: its token tells, so
    that `spark start` after an upgrade still restarts this home's server (it names no other)."""
    server = LocalSparkConnect(tmp_path, port=15124)
    server.prepare()
    command = [sys.executable, "-c", "import time; print(flush=True); time.sleep(60)", SERVER_CLASS,
               "spark.connect.grpc.binding.port=15124"]
    started = [subprocess.Popen(command, stdout=subprocess.PIPE, env={**os.environ, TOKEN_VARIABLE: token})
               for token in (server.token_file.read_text(), "another home's")]
    try:
        for proc in started:
            proc.stdout.readline()
        server.pid_file.write_text(str(started[0].pid))
        assert server.pid() == started[0].pid
        server.pid_file.write_text(str(started[1].pid))
        assert server.pid() is None
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_a_server_that_exits_at_its_start_says_why_from_its_log(tmp_path, monkeypatch, free_port):
    """No Java, or another Java: the end of the log, not a traceback naming the log file."""
    monkeypatch.setattr(LocalBroker, "command",
                        lambda self: [sys.executable, "-c", "import sys; print('Error: JAVA_HOME is not valid'); sys.exit(3)"])
    with pytest.raises(NotReady, match=r"exited with 3; the end of .*\n  Error: JAVA_HOME is not valid"):
        LocalBroker(tmp_path, port=free_port()).start(timeout=30)


def test_a_run_presents_the_home_s_server_its_token_and_refuses_it_started_on_other_code(running, tmp_path,
                                                                                         monkeypatch):
    """After an upgrade (`git pull`, setup) a server started before would run the old task code in
    its workers. The token is read from the server's folder, not from the master URL the UI shows."""
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    server = LocalSparkConnect(tmp_path / "spark", port=15124)
    started = running(SERVER_CLASS, server.folder_argument, "spark.connect.grpc.binding.port=15124")
    try:
        server.data_dir.mkdir()
        server.prepare()
        server.pid_file.write_text(str(started.pid))
        token = server.token_file.read_text()
        assert authenticated(server.url) == f"sc://localhost:15124/;session_id={SESSION_ID};token={token}"
        assert authenticated("sc://127.0.0.1:15124") == f"sc://localhost:15124/;token={token}"
        for other in ("sc://127.0.0.1:15125", "sc://spark.internal:15124/;session_id=x", "sc://localhost:x"):
            assert authenticated(other) == other
        server.fingerprint_file.write_text("the code before the upgrade")
        with pytest.raises(Outdated, match="started on other code than this run's.*entity-assets spark stop"):
            SparkResource(master=server.url).session()
    finally:
        started.kill()
        started.wait()


BARE_CLIENT = ("import sys; from pyspark.sql import SparkSession; "
               "SparkSession.builder.remote(sys.argv[1]).getOrCreate().range(3).count()")
RUN_CLIENT = ("import sys; from resources import SparkResource; "
              "print(SparkResource(master=sys.argv[1]).session().range(3).count())")


def _ipv6_decoy(port: int) -> socket.socket | None:
    """A listener on [::1]:`port` that a gRPC client of `localhost:port` reaches (checked with one),
    None where none would (a host without IPv6, or a resolver that gives 127.0.0.1 only)."""
    import errno

    import grpc

    try:
        sock = socket.socket(socket.AF_INET6)
        sock.bind(("::1", port))
    except OSError as exc:
        if exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            return None
        raise
    sock.listen()
    control = grpc.insecure_channel(f"localhost:{port}")
    try:
        grpc.channel_ready_future(control).result(timeout=5)
    except grpc.FutureTimeoutError:
        pass
    control.close()
    del control
    gc.collect()  # gRPC's own threads end with the channel: a try they make late would pass for the run's
    sock.settimeout(2)
    came = 0
    while True:  # the control's connections: so would a run's over `localhost` come
        try:
            sock.accept()[0].close()
        except TimeoutError:
            break
        came += 1
    if not came:
        sock.close()
        return None
    sock.setblocking(False)
    return sock


def test_the_local_server_serves_only_clients_that_present_its_token(tmp_path, free_port):
    """Any user of the host could otherwise run code on it, with the pipeline's environment."""
    env = {**os.environ, "ENTITY_ASSETS_HOME": str(tmp_path)}
    env.pop(TOKEN_VARIABLE, None)
    server = LocalSparkConnect(tmp_path / "spark", port=free_port())
    server.start(timeout=180)
    try:
        token = server.token_file.read_text()
        assert not any(token in a for a in _arguments(server.pid()))
        bare = subprocess.run([sys.executable, "-c", BARE_CLIENT, server.url], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert bare.returncode != 0 and "UNAUTHENTICATED" in bare.stderr, bare.stderr[-3000:]
        # another user's listener on ::1, the port our server holds on 127.0.0.1 only: gRPC tries
        # `localhost`'s ::1 first, and would send it the token (a host without IPv6 has no ::1)
        decoy = _ipv6_decoy(server.port)
        run = subprocess.run([sys.executable, "-c", RUN_CLIENT, server.url], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0 and run.stdout.strip() == "3", run.stderr[-3000:]
        if decoy is not None:
            with pytest.raises(BlockingIOError):
                decoy.accept()  # the run never came to it
            decoy.close()
        log = server.log_file.read_text()
        assert token not in log and "SessionHolder" not in log  # at WARN: no line per request
    finally:
        server.stop()


@pytest.mark.slow
def test_slices_on_spark_connect_write_what_a_local_session_writes(broker, make_pipeline, free_port, tmp_path,
                                                                   worker_daemons, lake_rows):
    traffic = samples.GraphTraffic(samples.BatchTraffic(patches=1200, entities=200, learning=True), devices=10)
    records = [*traffic.records(), *(("entity-batches", f"bad/{i}", v) for i, (_, v) in enumerate(samples.BAD_VALUES))]
    halves = records[:len(records) // 2], records[len(records) // 2:]
    local = make_pipeline(max_messages=500)
    server = LocalSparkConnect(tmp_path / "home" / "spark", port=free_port())  # the runs' home's: its token
    server.start(timeout=180)
    # The same input topics, read by both at the same points: the same slices, Kafka timestamps and all.
    env = {**os.environ, "ENTITY_ASSETS_HOME": str(tmp_path / "home"), "ENTITY_ASSETS_KAFKA_BOOTSTRAP": broker.bootstrap,
           "ENTITY_ASSETS_TOPIC_PREFIX": local.prefix, "ENTITY_ASSETS_SLICE_INTERVAL_SECONDS": "0",
           "ENTITY_ASSETS_SLICE_MAX_MESSAGES": "500", "ENTITY_ASSETS_SLICE_MAX_PER_TASK": "1000",
           "ENTITY_ASSETS_SPARK_MASTER": server.url, "ENTITY_ASSETS_SPARK_DRIVER_ROWS": "0"}
    env.pop("DAGSTER_HOME", None)
    try:
        for half in halves:  # two runs on the server from two client processes: one server session
            local.produce(half)
            assert all(r.success for r in local.tick_and_run())
            done = subprocess.run([sys.executable, "-c", RUN], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            assert "FAILED" not in done.stdout
        # On Spark 4.2 a session per run would have left a worker daemon per run (spark_connect.py).
        assert len(worker_daemons(server.pid())) == 1
    finally:
        server.stop()
    assert lake_rows(LakeResource(root=str(tmp_path / "home" / "lake"))) == lake_rows(local.lake)


def test_stopping_or_inspecting_the_server_reads_no_setting(tmp_path):
    """A setting that is not valid (a secret in the Spark conf) must not keep a server up: in a
    process of its own, as loading the code location checks every setting."""
    import os
    import subprocess

    env = {**os.environ, "ENTITY_ASSETS_HOME": str(tmp_path), "ENTITY_ASSETS_SPARK_CONF": "spark.hadoop.fs.s3a.secret.key=x"}
    command = [str(Path(sys.executable).parent / "entity-assets"), "spark"]
    for action, status in (("status", 0), ("stop", 0), ("start", 2)):
        done = subprocess.run([*command, action], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == status, (action, done.stderr)
    assert "holds a secret" in done.stderr
