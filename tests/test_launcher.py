"""Run workers checked by pid: what lets run monitoring free the lake pool from a dead run, and what
keeps `entity-assets run` from applying slices beside the daemon (the daemon itself: test_daemon.py)."""

import json
import os
import socket
import subprocess
import sys
import time

from dagster import DagsterRunStatus
from dagster._core.events import EngineEventData
from dagster._core.launcher import WorkerStatus
from dagster._core.storage.tags import GRPC_INFO_TAG
from dagster._core.test_utils import create_run_for_test

from entity_assets.launcher import WORKER_TAG, LocalRunLauncher, check_worker, process_alive, settle_runs

def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_process_is_alive_only_if_it_existed_when_the_run_saw_it():
    assert process_alive(os.getpid(), time.time())
    assert not process_alive(_dead_pid(), time.time())
    assert not process_alive(os.getpid(), 0.0)  # a pid reused by a newer process


def test_the_instance_checks_workers_of_runs_launched_through_a_code_server_and_of_the_cli(project_instance):
    instance = project_instance
    assert isinstance(instance.run_launcher, LocalRunLauncher)
    assert instance.run_launcher.supports_check_run_worker_health
    for host in ("localhost", "remote.example"):
        for pid in (os.getpid(), _dead_pid()):
            run = create_run_for_test(instance, status=DagsterRunStatus.STARTED,
                                      tags={GRPC_INFO_TAG: json.dumps({"host": host, "port": 4266})})
            instance.report_engine_event(f"Started process for run (pid: {pid}).", run, EngineEventData.in_process(pid))
            expected = WorkerStatus.FAILED if host == "localhost" and pid != os.getpid() else WorkerStatus.RUNNING
            assert instance.run_launcher.check_run_worker_health(run).status == expected, (host, pid)
    cli = create_run_for_test(instance, status=DagsterRunStatus.STARTED, tags={WORKER_TAG: f"{socket.gethostname()}:{_dead_pid()}"})
    health = check_worker(instance, cli)
    assert health.status == WorkerStatus.FAILED and "is gone" in health.msg
    unknown = create_run_for_test(instance, status=DagsterRunStatus.STARTED)
    assert check_worker(instance, unknown).status == WorkerStatus.RUNNING  # not checkable: never failed


def test_the_cli_fails_dead_runs_and_waits_for_live_or_starting_ones(project_instance):
    instance = project_instance
    assert settle_runs(instance, "kafka_offsets_sensor") == []
    dead = create_run_for_test(instance, status=DagsterRunStatus.STARTED, tags={WORKER_TAG: f"{socket.gethostname()}:{_dead_pid()}"})
    assert settle_runs(instance, "kafka_offsets_sensor") == []
    assert instance.get_run_by_id(dead.run_id).status == DagsterRunStatus.FAILURE
    live = create_run_for_test(instance, status=DagsterRunStatus.STARTED, tags={WORKER_TAG: f"{socket.gethostname()}:{os.getpid()}"})
    starting = create_run_for_test(instance, status=DagsterRunStatus.STARTING)
    reasons = settle_runs(instance, "kafka_offsets_sensor")
    assert {r.split()[1] for r in reasons} == {live.run_id, starting.run_id}
    assert instance.get_run_by_id(live.run_id).status == DagsterRunStatus.STARTED
