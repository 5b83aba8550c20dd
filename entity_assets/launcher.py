"""Run workers the instance can check: a run whose process died must not keep the lake pool.

Every lake-writing step is in one concurrency pool (partitions.LAKE_POOL), so a run that stays
STARTED after its process died stops every later slice. Dagster's run monitoring fails such runs
only through a run launcher that can check its workers, which the default one cannot. Runs here
are processes on this host (the code server's run workers, or `entity-assets run`), so their pid
tells: the worker logs it when it starts, and `entity-assets run` tags its runs with it.
"""

import functools
import json
import os
import signal
import socket
import time

from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    DefaultRunLauncher,
    RunsFilter,
)
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus
from dagster._core.scheduler.instigation import InstigatorStatus, InstigatorType
from dagster._core.storage.tags import GRPC_INFO_TAG

from entity_assets.partitions import LAKE_POOL

WORKER_TAG = "entity-assets/worker"
"""`host:pid` of the process running a run, for runs not launched through a code server."""

LAUNCHED_ON_TAG = "entity-assets/launched-on"
"""The host whose launcher started a run through a code server: the code server's `localhost`
(or Unix socket) is that host's, not the one of a process reading the run (`entity-assets run`
elsewhere, on a shared instance)."""

_STARTED = "Started process for run (pid: "
UNFINISHED = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
              DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
DAEMON_HEARTBEAT_SECONDS = 120


def worker_tag() -> dict[str, str]:
    return {WORKER_TAG: f"{socket.gethostname()}:{os.getpid()}"}


@functools.cache
def _local_names() -> frozenset[str]:
    # once per process: getfqdn may ask the resolver, and run monitoring checks every 30 s
    return frozenset({"localhost", "127.0.0.1", "::1", "", socket.gethostname(), socket.getfqdn()})


def _local(host: str) -> bool:
    return host in _local_names()


def run_worker(instance: DagsterInstance, run: DagsterRun, by_launcher: bool = True) -> tuple[int, float] | None:
    """(pid, time it was seen running) of the run's worker on this host; None when unknown here.

    `by_launcher`: asked by the launcher's host (run monitoring), whose code server's `localhost`
    it is, even where the host was recreated since (a pod's new name: its old workers are gone);
    else (`entity-assets run`, anywhere) only of runs that this host's launcher tagged."""
    if WORKER_TAG in run.tags:
        host, _, pid = run.tags[WORKER_TAG].rpartition(":")
        record = instance.get_run_record_by_id(run.run_id)
        since = record.start_time if record and record.start_time else time.time()
        return (int(pid), since) if _local(host) else None
    grpc = run.tags.get(GRPC_INFO_TAG)
    if grpc is None:
        return None
    info = json.loads(grpc)
    if "socket" not in info and not _local(info.get("host", "")):
        return None
    if not by_launcher and run.tags.get(LAUNCHED_ON_TAG, socket.gethostname()) != socket.gethostname():
        return None  # `localhost` of another host (a run launched before the tag was: as this host's)
    for record in instance.get_records_for_run(
        run.run_id, of_type=DagsterEventType.ENGINE_EVENT, limit=50
    ).records:
        entry = record.event_log_entry
        if entry.message and entry.message.startswith(_STARTED):
            return int(entry.message[len(_STARTED):].rstrip(").")), entry.timestamp
    return None


def process_alive(pid: int, since: float) -> bool:
    """Whether `pid` is a live process that already existed at `since` (not a reused pid). Another
    user's too is checked for its start: after a reboot a dead worker's pid may be root's."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, and its /proc stat is readable all the same
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, StopIteration):
        return True  # no procfs: the pid exists, which is all that can be told
    state, started_ticks = fields[0], int(fields[19])
    started = boot + started_ticks / os.sysconf("SC_CLK_TCK")
    return state not in ("Z", "X") and started <= since + 2


def check_worker(instance: DagsterInstance, run: DagsterRun, by_launcher: bool = True) -> CheckRunHealthResult:
    worker = run_worker(instance, run, by_launcher)
    if worker is None:
        # Not a process of this host (or not started yet): only its own launcher could tell.
        return CheckRunHealthResult(WorkerStatus.RUNNING, "run worker not checkable from this host")
    pid, since = worker
    if process_alive(pid, since):
        return CheckRunHealthResult(WorkerStatus.RUNNING, f"run worker pid {pid} is running")
    return CheckRunHealthResult(WorkerStatus.FAILED, f"run worker pid {pid} on {socket.gethostname()} is gone")


class LocalRunLauncher(DefaultRunLauncher):
    """The default launcher, plus health checks of run workers on this host for run monitoring,
    and termination of `entity-assets run`'s runs, which no code server runs."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        return check_worker(self._instance, run)

    def launch_run(self, context) -> None:
        self._instance.add_run_tags(context.dagster_run.run_id, {LAUNCHED_ON_TAG: socket.gethostname()})
        super().launch_run(context)

    def terminate(self, run_id: str) -> bool:
        """A run of `entity-assets run` is interrupted in its process, as Ctrl-C would: the
        default launcher finds no code server to ask, so run monitoring would mark the run
        canceled after its timeout while the process went on writing, beside the next run of
        the lake pool."""
        run = self._instance.get_run_by_id(run_id)
        worker = run_worker(self._instance, run) if run is not None and WORKER_TAG in run.tags else None
        if worker is None or run.is_finished or not process_alive(*worker):
            return super().terminate(run_id)
        # canceling before the signal: the interrupted process reads the status to tell a
        # termination from a crash, and a signal first failed the run when it read sooner
        self._instance.report_run_canceling(run)
        try:
            os.kill(worker[0], signal.SIGINT)
        except OSError:  # another user's process, or gone meanwhile
            return super().terminate(run_id)
        return True


def settle_runs(instance: DagsterInstance, sensor_name: str) -> list[str]:
    """Why a run outside the daemon's queue (`entity-assets run`) must not start now; empty when it may.

    Unfinished runs whose worker is gone are failed on the way, as run monitoring would: they
    only hold the pool. Any other unfinished run with a step in the lake pool, or the sensor on
    with a live daemon, would apply slices beside this process; a run of no lake step (a trace,
    a history, another location's job) would not.
    """
    reasons = []
    heartbeat = instance.get_daemon_heartbeats().get("SENSOR")
    on = [s for s in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
          if s.name == sensor_name and s.status == InstigatorStatus.RUNNING]
    if on and heartbeat and time.time() - heartbeat.timestamp < DAEMON_HEARTBEAT_SECONDS:
        # its run monitoring fails its dead runs: failed from here, a live one of another host would free the pool
        return [f"sensor {sensor_name} is on and a daemon is running it"]
    for record in instance.get_run_records(RunsFilter(statuses=UNFINISHED)):
        run = record.dagster_run
        pools = run.run_op_concurrency.all_pools if run.run_op_concurrency else None  # None: no step in a pool
        if LAKE_POOL not in (pools or ()):
            continue
        if run.status == DagsterRunStatus.STARTED:
            health = check_worker(instance, run, by_launcher=False)
            if health.status == WorkerStatus.FAILED:
                instance.report_run_failed(run, f"{health.msg}: failed before a new run of the lake pool")
                continue
        reasons.append(f"run {run.run_id} ({run.job_name}, slice {run.tags.get('dagster/partition', '-')}) "
                       f"is {run.status.value}")
    return reasons
