"""The daemon's path, as a deployment runs it: `scripts/ui.sh` (webserver and daemon on the project's
dagster.yaml), the sensor turned on and an asset backfill launched through the webserver's GraphQL
API, as the UI does, after a killed `entity-assets run` left a run holding the lake pool. Slow:
each run is a process of its own."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter
from deltalake import DeltaTable

from entity_assets import samples
from entity_assets.cli import produce_records
from entity_assets.ingest import INPUT_STREAMS
from entity_assets.kafka_io import ensure_topics
from entity_assets.launcher import LAUNCHED_ON_TAG
from entity_assets.publish import STREAMS
from entity_assets.spark_connect import LocalSparkConnect
from resources import KafkaResource, LakeResource

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
LOCATION = {"repositoryLocationName": "entity_assets", "repositoryName": "__repository__"}
TABLES = ("entity_batches", "entity_updates", "entities", "complete_responses", "changes_by_device")


def _graphql(port: int, query: str, variables: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", json.dumps(
        {"query": query, "variables": variables}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["data"]


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(2)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def _finished(instance: DagsterInstance, count: int, **filters) -> list:
    """The runs of `filters` once `count` of them ended, oldest first; a failed one fails the test."""
    records = instance.get_run_records(RunsFilter(**filters))
    failed = [r.dagster_run for r in records if r.dagster_run.status == DagsterRunStatus.FAILURE]
    assert not failed, f"run {failed[0].run_id} of slice {failed[0].tags.get('dagster/partition')} failed"
    done = [r for r in records if r.dagster_run.status == DagsterRunStatus.SUCCESS]
    return sorted(done, key=lambda r: r.start_time) if len(done) >= count else []


def _one_at_a_time_in_order(records) -> list[str]:
    for before, after in zip(records, records[1:]):
        assert before.end_time <= after.start_time, "two runs of the lake pool overlapped"
    keys = [r.dagster_run.tags["dagster/partition"] for r in records]
    assert keys == sorted(keys), f"slices ran in the order {keys}"
    # the launcher names its host: a code server's localhost is that host's (launcher.check_worker)
    assert {r.dagster_run.tags.get(LAUNCHED_ON_TAG) for r in records} == {socket.gethostname()}
    return keys


def _rows(lake: Path) -> dict[str, int]:
    return {t: DeltaTable(str(lake / t)).to_pyarrow_dataset().count_rows() for t in TABLES}


@pytest.mark.timeout(1100)  # its waits add up to 1,020 s (it takes ~100 s), so one that runs out fails naming what it waited for
def test_sensor_runs_and_an_asset_backfill_apply_slices_one_at_a_time_in_order(broker, free_port, tmp_path, monkeypatch,
                                                                               worker_daemons,
                                                                               lake_rows):
    home, port, spark_port = tmp_path / "home", free_port(), free_port()
    kafka = KafkaResource(bootstrap_servers=broker.bootstrap, topic_prefix="daemon.")
    ensure_topics(kafka.config(), [kafka.topic(s) for s in INPUT_STREAMS], 4)
    traffic = samples.GraphTraffic(samples.BatchTraffic(patches=1200, entities=200, learning=True), devices=10)
    produce_records(traffic.records(), kafka=kafka)
    env = {**os.environ, "ENTITY_ASSETS_HOME": str(home), "ENTITY_ASSETS_KAFKA_BOOTSTRAP": broker.bootstrap,
           "ENTITY_ASSETS_TOPIC_PREFIX": "daemon.", "ENTITY_ASSETS_SLICE_INTERVAL_SECONDS": "0",
           "ENTITY_ASSETS_SLICE_MAX_MESSAGES": "500", "ENTITY_ASSETS_SPARK_CONNECT_PORT": str(spark_port),
           "PORT": str(port),
           # Slices this small run in the run's own process, without Spark: let them use ui.sh's server.
           "ENTITY_ASSETS_SPARK_DRIVER_ROWS": "0"}
    for name in ("DAGSTER_HOME", "ENTITY_ASSETS_SPARK_MASTER"):  # ui.sh's runs use its Spark Connect server
        env.pop(name, None)
    spark_connect = LocalSparkConnect(home / "spark", port=spark_port)
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster"))  # this process opens ui.sh's instance (its dagster.yaml's storage)

    # `entity-assets run` killed in its first slice: its run stays STARTED and holds the lake pool.
    with open(tmp_path / "run.log", "wb") as log:
        cli = subprocess.Popen([str(REPO / ".venv/bin/entity-assets"), "run"], cwd=REPO,
                               env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        def cli_run_started():
            assert cli.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            if "sensor:" not in (tmp_path / "run.log").read_text():
                return None  # the instance's storage is not created yet
            with DagsterInstance.from_config(str(home / "dagster")) as instance:
                return next(iter(instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED]))), None)
        stale = _wait(cli_run_started, 120, "the CLI's first run")
    finally:
        cli.kill()
        cli.wait()
    assert stale.tags["dagster/partition"] == "0000000001"

    with open(tmp_path / "ui.log", "wb") as log:  # the child keeps its own descriptor
        ui = subprocess.Popen(["bash", "scripts/ui.sh"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log,
                              start_new_session=True)  # its group: dagster dev's webserver, daemon and code server
    instance = None
    try:
        def serving():
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5).status == 200
            except OSError:
                assert ui.poll() is None, (tmp_path / "ui.log").read_text()[-3000:]
                return False
        _wait(serving, 300, "the webserver")  # after set-up, a Spark Connect JVM (180 s allowed) and dagster dev

        def location_loaded():  # the webserver serves before its code server has loaded the location
            entries = _graphql(port, "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus "
                                     "locationOrLoadError { __typename ... on PythonError { message } } } } } }",
                               {})["workspaceOrError"]["locationEntries"]
            [entry] = [e for e in entries if e["name"] == LOCATION["repositoryLocationName"]]
            loaded = entry["locationOrLoadError"] or {}
            assert loaded.get("__typename") != "PythonError", loaded.get("message")
            return entry["loadStatus"] == "LOADED" and loaded.get("__typename") == "RepositoryLocation"
        _wait(location_loaded, 120, "the code location")
        instance = DagsterInstance.from_config(str(home / "dagster"))
        # The sensor's first tick closes three slices and requests their runs at once.
        started = _graphql(port, "mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) { __typename } }",
                           {"s": {**LOCATION, "sensorName": "kafka_offsets_sensor"}})
        assert started["startSensor"]["__typename"] == "Sensor"
        sensor_runs = _wait(lambda: _finished(instance, 3, tags={"dagster/sensor_name": "kafka_offsets_sensor"}),
                            240, "three slice runs")
        assert _one_at_a_time_in_order(sensor_runs) == ["0000000001", "0000000002", "0000000003"]
        # Run monitoring failed the CLI's run, whose worker was gone, and the queue went on.
        failure = instance.get_records_for_run(stale.run_id, of_type=DagsterEventType.RUN_FAILURE).records
        assert instance.get_run_by_id(stale.run_id).status == DagsterRunStatus.FAILURE
        assert "is gone" in failure[0].event_log_entry.message
        # ... and `entity-assets run` refuses to apply slices beside a daemon running the sensor.
        refused = subprocess.run([str(REPO / ".venv/bin/entity-assets"), "run"], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "sensor kafka_offsets_sensor is on" in refused.stderr, refused.stderr
        rows = _rows(home / "lake")
        assert rows["entity_batches"] > 0 and rows["changes_by_device"] > 0
        content = lake_rows(LakeResource(root=str(home / "lake")))

        # The UI's Materialize of every asset over the three slices: an asset backfill, one run
        # per slice of Dagster's asset job, none of them the sensor's job.
        # (as the UI's Materialize all selects them: every asset but the Kafka topics, external)
        nodes = _graphql(port, "{ assetNodes { assetKey { path } isMaterializable } }", {})["assetNodes"]
        assets = [n["assetKey"] for n in nodes if n["isMaterializable"]]
        assert {tuple(n["assetKey"]["path"]) for n in nodes if not n["isMaterializable"]} == {
            ("kafka", s) for s in (*INPUT_STREAMS, "ingestion", *(stream.name for stream in STREAMS.values()))}
        launched = _graphql(port, """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) {
            __typename ... on LaunchBackfillSuccess { backfillId } } }""",
                            {"p": {"partitionNames": ["0000000001", "0000000002", "0000000003"],
                                   "assetSelection": assets, "fromFailure": False}})["launchPartitionBackfill"]
        assert launched["__typename"] == "LaunchBackfillSuccess", launched
        backfill_runs = _wait(lambda: _finished(instance, 3, tags={"dagster/backfill": launched["backfillId"]}),
                              240, "the backfill's three runs")
        assert _one_at_a_time_in_order(backfill_runs) == ["0000000001", "0000000002", "0000000003"]
        assert sensor_runs[-1].end_time <= backfill_runs[0].start_time
        assert lake_rows(LakeResource(root=str(home / "lake"))) == content  # replayed slices rewrite their rows in place
        # The runs used ui.sh's Spark Connect server, in its one shared session: one worker daemon
        assert spark_connect.pid() is not None and len(worker_daemons(spark_connect.pid())) == 1
    finally:
        if instance is not None:
            instance.dispose()
        ui.send_signal(signal.SIGTERM)
        try:
            ui.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(ui.pid, signal.SIGKILL)
        spark_connect.stop()
