"""Run workers checked by pid: what lets run monitoring free the lake pool from a dead run, and what
keeps `entity-assets run` from applying slices beside the daemon (the daemon itself: test_daemon.py)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from dagster import DagsterRunStatus
from dagster._core.events import EngineEventData
from dagster._core.launcher import WorkerStatus
from dagster._core.storage.tags import GRPC_INFO_TAG
from dagster._core.test_utils import create_run_for_test

from entity_assets.launcher import (LAUNCHED_ON_TAG, WORKER_TAG, LocalRunLauncher, check_worker, process_alive,
                                    settle_runs)

def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_process_is_alive_only_if_it_existed_when_the_run_saw_it():
    assert process_alive(os.getpid(), time.time())
    assert not process_alive(_dead_pid(), time.time())
    assert not process_alive(os.getpid(), 0.0)  # a pid reused by a newer process


def test_another_user_s_process_that_reused_the_pid_is_no_worker(monkeypatch):
    """After a reboot a dead worker's pid may be a root process's, which a daemon may not signal:
    the run stayed RUNNING forever, holding the lake pool's slot."""
    def not_permitted(pid, signal):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", not_permitted)
    assert not process_alive(os.getpid(), 0.0)
    assert process_alive(os.getpid(), time.time())


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
    from entity_assets.definitions import defs

    instance = project_instance

    def lake_run(status, tags=None):  # a slice run: its steps are in the lake pool
        return instance.create_run_for_job(job_def=defs.resolve_job_def("slice_job"), status=status, tags=tags)

    assert settle_runs(instance, "kafka_offsets_sensor") == []
    dead = lake_run(DagsterRunStatus.STARTED, {WORKER_TAG: f"{socket.gethostname()}:{_dead_pid()}"})
    assert settle_runs(instance, "kafka_offsets_sensor") == []
    assert instance.get_run_by_id(dead.run_id).status == DagsterRunStatus.FAILURE
    live = lake_run(DagsterRunStatus.STARTED, {WORKER_TAG: f"{socket.gethostname()}:{os.getpid()}"})
    starting = lake_run(DagsterRunStatus.STARTING)
    # a run of no lake step (a trace, another location's job) applies no slice: never waited for
    create_run_for_test(instance, status=DagsterRunStatus.NOT_STARTED, job_name="history_job")
    reasons = settle_runs(instance, "kafka_offsets_sensor")
    assert {r.split()[1] for r in reasons} == {live.run_id, starting.run_id}
    assert instance.get_run_by_id(live.run_id).status == DagsterRunStatus.STARTED


def test_the_cli_fails_no_run_of_another_host_nor_any_while_a_daemon_runs_the_sensor(project_instance, monkeypatch):
    """On an instance shared by hosts, a code server's `localhost` is the launching host's: from
    another host, `entity-assets run` took a live run for dead, failed it and freed the pool."""
    from types import SimpleNamespace

    from dagster._core.scheduler.instigation import InstigatorStatus

    from entity_assets.definitions import defs

    instance = project_instance
    elsewhere = create_run_for_test(instance, status=DagsterRunStatus.STARTED, tags={
        GRPC_INFO_TAG: json.dumps({"host": "localhost", "port": 4266}), LAUNCHED_ON_TAG: "daemon-host"})
    instance.report_engine_event(f"Started process for run (pid: {_dead_pid()}).", elsewhere,
                                 EngineEventData.in_process(1))
    assert check_worker(instance, elsewhere, by_launcher=False).status == WorkerStatus.RUNNING  # not from here
    # run monitoring, on the launcher's host: a pod recreated under a new name fails its old runs
    assert instance.run_launcher.check_run_worker_health(elsewhere).status == WorkerStatus.FAILED
    dead = instance.create_run_for_job(job_def=defs.resolve_job_def("slice_job"), status=DagsterRunStatus.STARTED,
                                       tags={WORKER_TAG: f"{socket.gethostname()}:{_dead_pid()}"})
    monkeypatch.setattr(instance, "get_daemon_heartbeats", lambda: {"SENSOR": SimpleNamespace(timestamp=time.time())})
    monkeypatch.setattr(instance, "all_instigator_state", lambda **_: [
        SimpleNamespace(name="kafka_offsets_sensor", status=InstigatorStatus.RUNNING)])
    assert settle_runs(instance, "kafka_offsets_sensor") == ["sensor kafka_offsets_sensor is on and a daemon is "
                                                             "running it"]
    assert instance.get_run_by_id(dead.run_id).status == DagsterRunStatus.STARTED  # the daemon's monitoring's to fail


SLOW_CLI_RUN = """
import time
from dagster import DagsterInstance, job, op
from entity_assets.launcher import worker_tag

@op
def slow():
    time.sleep(60)

@job
def slow_job():
    slow()

with DagsterInstance.get() as instance:
    print(slow_job.execute_in_process(instance=instance, tags=worker_tag(), raise_on_error=False).success)
"""


def test_terminating_a_run_of_the_cli_interrupts_its_process(project_instance):
    """No code server runs `entity-assets run`'s runs: the default launcher would ask none, and run
    monitoring would mark the run canceled after its timeout while the process went on writing."""
    instance = project_instance
    child = subprocess.Popen([sys.executable, "-c", SLOW_CLI_RUN], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
    try:
        deadline = time.time() + 60
        while not (runs := instance.get_runs()) or runs[0].status != DagsterRunStatus.STARTED:
            assert time.time() < deadline and child.poll() is None
            time.sleep(0.2)
        assert instance.run_launcher.terminate(runs[0].run_id)
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert out.strip() == "False"
    assert instance.get_run_by_id(runs[0].run_id).status == DagsterRunStatus.CANCELED


def test_a_run_of_the_cli_is_canceling_before_its_process_is_interrupted(project_instance, monkeypatch):
    """The interrupted process reads the run's status to tell a termination from a crash: read
    before the launcher marked it canceling, the run failed."""
    from entity_assets import launcher

    instance = project_instance
    run = create_run_for_test(instance, status=DagsterRunStatus.STARTED, tags=launcher.worker_tag())
    seen, kill = [], os.kill

    def interrupt(pid, sig):  # the signal only: whether the process lives (0) is asked for real
        if sig:
            seen.append((pid, sig, instance.get_run_by_id(run.run_id).status))
        else:
            kill(pid, sig)

    monkeypatch.setattr(launcher.os, "kill", interrupt)
    assert instance.run_launcher.terminate(run.run_id)
    assert seen == [(os.getpid(), signal.SIGINT, DagsterRunStatus.CANCELING)]
