"""Helpers shared by the benches: a private home and broker, producing, timing, CPU and memory.

Every bench runs against its own temporary ENTITY_ASSETS_HOME and its own broker port, so it
never touches a developer's `.entity-assets` nor a broker another bench or test is using.

    with BenchEnv(port=0) as env:          # temp home, env vars, DAGSTER_HOME; broker started
        env.produce_batches(n)             # in a child process: the driver's RSS stays clean
        ...                                # import entity_assets.definitions only after this point
    # broker stopped by its pid, temp home removed (unless keep=True)

Memory: `driver_peak_mb()` is this process's peak RSS (getrusage). Spark's JVM is a child
process and the Python workers are children of the JVM; `ResourceSampler` follows both, and
measures the CPU other people's processes take on a shared machine (`foreign`).

Also runnable: `python bench/common.py produce --bootstrap HOST:PORT --n N` (used by
`BenchEnv.produce_batches`), which prints one JSON line with the counts and timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

INPUT_PARTITIONS = 4  # what `entity-assets broker start` creates by default


# --------------------------------------------------------------------------- timing and output


class Timer:
    """`with Timer() as t: ...` then `t.s` (seconds, monotonic clock)."""

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        self.s = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.start


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def step_seconds(summaries: list[dict]) -> dict[str, float]:
    """Seconds per step over slice runs (`cli.run_pending` summaries)."""
    total: dict[str, float] = {}
    for summary in summaries:
        for step, sec in summary["steps"].items():
            total[step] = total.get(step, 0) + sec
    return total


def step_windows(summaries: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """(start, end) unix times of each step's executions over slice runs, from the runs' event logs."""
    from dagster import DagsterInstance

    instance, windows = DagsterInstance.get(), {}
    for summary in summaries:
        started: dict[str, float] = {}
        for entry in instance.all_logs(summary["run_id"]):
            event = entry.dagster_event
            if event is None or event.step_key is None:
                continue
            if event.event_type_value == "STEP_START":
                started[event.step_key] = entry.timestamp
            elif event.event_type_value == "STEP_SUCCESS" and event.step_key in started:
                windows.setdefault(event.step_key, []).append((started.pop(event.step_key), entry.timestamp))
    return windows


def kv_line(**values) -> str:
    """The machine-readable last line: `k=v` pairs, floats rounded, no spaces inside values."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v).replace(" ", "_")

    return " ".join(f"{k}={fmt(v)}" for k, v in values.items())


# --------------------------------------------------------------------------- memory


def driver_peak_mb() -> float:
    """Peak RSS of this process (Linux reports ru_maxrss in KiB). Children are not included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_kb(pid: int, field_name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def vm_hwm_mb(pid: int) -> float | None:
    """A process's own peak RSS (VmHWM), readable while it is alive."""
    kb = _status_kb(pid, "VmHWM")
    return None if kb is None else kb / 1024


def jvm_pid(spark) -> int | None:
    """The pid of the session's JVM: the gateway's process (spark-submit execs java)."""
    try:
        pid = spark.sparkContext._gateway.proc.pid
    except AttributeError:
        return None
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/comm").read_text().strip() == "java":
            return pid
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/comm").read_text().strip() == "java":
                return child
    return pid


_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (all its threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0.0


def system_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat, everything but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / _TICK


class ResourceSampler:
    """Samples, in a daemon thread, CPU and memory of the bench's processes and of the machine.

    Groups: `driver` (this process), `jvm` (Spark's JVM), `workers` (the JVM's descendants:
    Spark's Python workers), `broker`. For each it adds up CPU seconds over the window (a
    process that exits between two samples loses at most one interval); `foreign_cpu_s` is the
    machine's busy CPU not used by those groups: other people's work competing for the cores.
    Memory: the sampled peak of the workers' RSS sum (forked workers share pages, so it is an
    upper bound), and each worker's own peak (VmHWM) as last seen.
    """

    def __init__(self, *, jvm: int | None, broker: int | None, interval: float = 0.5):
        self.jvm, self.broker, self.interval = jvm, broker, interval
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._group: dict[int, str] = {}
        self.timeline: list[tuple[float, dict[str, float]]] = []
        """(unix time, CPU seconds per group since the window opened) at each sample: `cpu_between`."""
        self.workers_peak_mb = 0.0
        self.workers_max = 0
        self.worker_hwm_mb: dict[int, float] = {}
        self._samples = 0
        self._jvm_children: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)

    def _pids(self) -> dict[int, str]:
        pids = {os.getpid(): "driver"}
        if self.broker:
            pids[self.broker] = "broker"
        if self.jvm:
            pids[self.jvm] = "jvm"
            # The JVM has dozens of threads to scan for children: do it every 5th sample only;
            # the worker daemon (one thread) is scanned every time for the workers it forks.
            self._samples += 1
            if self._samples % 5 == 1:
                self._jvm_children = _children(self.jvm)
            for child in self._jvm_children:
                pids[child] = "workers"
                for p in descendants(child):
                    pids[p] = "workers"
        return pids

    def sample(self) -> None:
        pids = self._pids()
        rss = 0.0
        for pid, group in pids.items():
            c = cpu_s(pid)
            if c is None:
                continue
            # A process first seen during the window started during it: it counts from zero.
            self._first.setdefault(pid, c if self._started is None else 0.0)
            self._last[pid], self._group[pid] = c, group
            if group == "workers":
                rss += rss_mb(pid)
                hwm = vm_hwm_mb(pid)
                if hwm is not None:
                    self.worker_hwm_mb[pid] = hwm
        if self._started is not None:
            self.timeline.append((time.time(), self._totals()))
        if rss > self.workers_peak_mb:
            self.workers_peak_mb = rss
            self.workers_max = sum(1 for g in pids.values() if g == "workers")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "ResourceSampler":
        self._started = None
        self.sample()
        self._started = time.perf_counter()
        self._busy0 = system_busy_s()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        self.busy_s = system_busy_s() - self._busy0
        self.wall_s = time.perf_counter() - self._started

    def _totals(self) -> dict[str, float]:
        out = {"driver": 0.0, "jvm": 0.0, "workers": 0.0, "broker": 0.0}
        for pid, last in self._last.items():
            out[self._group[pid]] += last - self._first[pid]
        return out

    def cpu(self) -> dict[str, float]:
        out = self._totals()
        out["foreign"] = max(0.0, self.busy_s - sum(out.values()))
        return out

    def cpu_between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds per group between two unix times, from the samples nearest to them.

        Tells a step's JVM or broker time apart, which a Python profile cannot see.
        """
        def at(t: float) -> dict[str, float]:
            return min(self.timeline, key=lambda sample: abs(sample[0] - t))[1] if self.timeline else {}

        before, after = at(start), at(end)
        return {group: after[group] - before[group] for group in after}


# --------------------------------------------------------------------------- environment and broker


@dataclass
class BenchEnv:
    """A temporary project home with its own broker; set up before importing the definitions.

    `entity_assets.definitions` builds its resources from the environment at import time, so
    this must be entered before anything imports it.
    """

    port: int = 0  # 0: a free port
    partitions: int = INPUT_PARTITIONS
    keep: bool = False
    cluster: str | None = None
    """Bootstrap servers of a Kafka cluster to use instead of starting the embedded broker: the
    run's topics get a prefix of their own and are deleted at the end; the broker's CPU is not
    this machine's to measure."""
    home: Path = field(init=False)
    broker_pid: int | None = field(init=False, default=None)
    topic_prefix: str = field(init=False, default="")

    def __enter__(self) -> "BenchEnv":
        from entity_assets.broker import LocalBroker
        from entity_assets.local_service import free_port

        self.port = self.port or free_port()
        self.home = Path(tempfile.mkdtemp(prefix="entity-assets-bench-"))
        if self.cluster:
            self.topic_prefix = f"{self.home.name}."
        os.environ["ENTITY_ASSETS_HOME"] = str(self.home)
        os.environ["ENTITY_ASSETS_KAFKA_BOOTSTRAP"] = self.bootstrap
        os.environ["ENTITY_ASSETS_TOPIC_PREFIX"] = self.topic_prefix
        os.environ.pop("ENTITY_ASSETS_LAKE", None)
        dagster_home = self.home / "dagster"
        dagster_home.mkdir()
        shutil.copyfile(REPO / "dagster.yaml", dagster_home / "dagster.yaml")
        os.environ["DAGSTER_HOME"] = str(dagster_home)
        self.broker = LocalBroker(self.home / "broker", port=self.port)
        # SIGTERM (e.g. a timeout) should still stop the broker through __exit__.
        self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            if self.cluster:
                log(f"cluster {self.cluster}, topics {self.topic_prefix}* (home {self.home})")
            else:
                with Timer() as t:
                    self.broker_pid = self.broker.start()
                log(f"broker pid {self.broker_pid} on {self.bootstrap} ready in {t.s:.1f}s (home {self.home})")
            self._ensure_topics()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    @property
    def bootstrap(self) -> str:
        return self.cluster or f"127.0.0.1:{self.port}"

    def client_config(self) -> dict[str, str]:
        """The bench's own admin clients' settings: on a cluster the Kafka resource's, so the
        security settings the pipeline takes from the environment (KAFKA_SECURITY_PROTOCOL,
        KAFKA_SASL_*, docs/operations.md) apply to them too."""
        if not self.cluster:
            return {"bootstrap.servers": self.bootstrap}
        from entity_assets.cli import kafka_resource

        return kafka_resource().config()

    def _ensure_topics(self) -> None:
        from entity_assets.ingest import INPUT_STREAMS
        from entity_assets.kafka_io import ensure_topics

        ensure_topics(self.client_config(), [self.topic_prefix + s for s in INPUT_STREAMS], self.partitions)

    def _delete_topics(self) -> None:
        """The run's topics on the cluster (those of its prefix)."""
        from confluent_kafka.admin import AdminClient

        from entity_assets.kafka_io import cluster_metadata, release_producers

        release_producers()  # an idle producer's metadata refresh would create a deleted topic again
        config = self.client_config()
        admin = AdminClient(config)
        topics = [t for t in cluster_metadata(config, 30, admin).topics if t.startswith(self.topic_prefix)]
        if topics:
            for future in admin.delete_topics(topics, operation_timeout=30).values():
                future.result(60)
        log(f"deleted {len(topics)} topics {self.topic_prefix}* on {self.cluster}")

    def produce_batches(self, n: int, *, entities: int | None = None, ops: int = 3, seed: int = 7,
                        cdc: str | None = None, schema_topic: bool = False) -> dict:
        """Produces BatchTraffic(patches=n, entities=n//10, ops=3) to entity-batches, or with `cdc` (a
        format) about n records of the sample CDC traffic of that format to its ingestion topic, in
        a child process (generating 1M values costs a few hundred MB that must not count as the
        driver's memory); returns the child's report (`batches`: the entity_batches rows to expect)."""
        cmd = [sys.executable, str(Path(__file__).resolve()), "produce", "--bootstrap", self.bootstrap,
               "--topic-prefix", self.topic_prefix,
               "--n", str(n), "--ops", str(ops), "--seed", str(seed), "--partitions", str(self.partitions)]
        if entities is not None:
            cmd += ["--entities", str(entities)]
        if cdc is not None:
            cmd += ["--cdc", cdc]
        if schema_topic:
            cmd += ["--schema-topic"]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    def stop_broker(self) -> None:
        """SIGTERM the broker by its pid and wait for it to exit (it saves its data first)."""
        if self.broker_pid is None:
            return
        _stop_spark()
        pid, self.broker_pid = self.broker_pid, None
        with Timer() as t:
            if self.broker.pid() == pid:
                self.broker.stop()
            else:  # the pid file is gone or names another process: signal the pid we started
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                    for _ in range(300):
                        os.kill(pid, 0)
                        time.sleep(0.1)
                    os.kill(pid, signal.SIGKILL)
        log(f"broker pid {pid} stopped in {t.s:.1f}s")

    def __exit__(self, *exc) -> None:
        try:
            self.stop_broker()
            if self.cluster and not self.keep:
                _stop_spark()
                self._delete_topics()
        finally:
            signal.signal(signal.SIGTERM, self._old_term)
            if not self.keep:
                shutil.rmtree(self.home, ignore_errors=True)
            else:
                log(f"kept {self.home}")


def _stop_spark() -> None:
    """Before the broker or the run's topics go: Spark's Python workers keep the producer of their
    last publish (`kafka_io.BatchProducer`), which would retry (and log each try) until they exit."""
    from pyspark.sql import SparkSession

    if (session := SparkSession.getActiveSession()) is not None:
        session.stop()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# --------------------------------------------------------------------------- producing (child process)

QLIK_SCHEMA_TOPIC = "hr.schemas.ingestion"


def _produce_main(args) -> int:
    from entity_assets.kafka_io import ensure_topics, produce
    from entity_assets.samples import CDC_STREAMS, BatchTraffic, CdcTraffic

    config = {"bootstrap.servers": args.bootstrap}
    if args.cdc:
        topic = next(s for s, fmt in CDC_STREAMS.items() if fmt == args.cdc)
        ensure_topics(config, [args.topic_prefix + topic], args.partitions)
        # each row: its insert, two changes, and every tenth its delete
        traffic = CdcTraffic(rows=max(1, args.n * 10 // 31), changes=2, seed=args.seed, streams=(topic,))
    else:
        topic = "entity-batches"
        entities = args.entities if args.entities is not None else max(1, args.n // 10)
        traffic = BatchTraffic(patches=args.n, entities=entities, ops=args.ops, seed=args.seed)
    size = registrations = 0
    metadata: list[tuple] = []  # with --schema-topic, produced to QLIK_SCHEMA_TOPIC after the data

    def records():
        nonlocal size, registrations
        for stream, key, value in traffic.records():
            assert stream == topic
            size += len(value or b"")  # a DB2 delete has no value
            registrations += key == "metadata"  # a Qlik metadata message: an avro_schemas row
            if key == "metadata" and args.schema_topic:
                metadata.append((key, value))
                continue
            yield key, value

    with Timer() as t:
        count = produce(config, args.topic_prefix + topic, records())
        if metadata:
            ensure_topics(config, [args.topic_prefix + QLIK_SCHEMA_TOPIC], 1)
            count += produce(config, args.topic_prefix + QLIK_SCHEMA_TOPIC, metadata)
    print(json.dumps({"stream": topic, "messages": count, "batches": count - registrations, "bytes": size,
                      "seconds": round(t.s, 2), "per_s": round(count / t.s), "peak_rss_mb": round(driver_peak_mb())}),
          flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bench helpers")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("produce", help="produce BatchTraffic to entity-batches")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic-prefix", default="", help="before every topic name (ENTITY_ASSETS_TOPIC_PREFIX)")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--entities", type=int, default=None)
    p.add_argument("--ops", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--partitions", type=int, default=4, help="of the CDC topic it creates")
    p.add_argument("--cdc", default=None, help="a CDC format: its sample traffic instead of entity batches")
    p.add_argument("--schema-topic", action="store_true",
                   help=f"Qlik's metadata messages on {QLIK_SCHEMA_TOPIC}, not on the data topic")
    args = parser.parse_args(argv)
    return _produce_main(args)


if __name__ == "__main__":
    sys.exit(main())


# --------------------------------------------------------------------------- profiling (optional)


class Profiler:
    """py-spy on the driver and on Spark's Python worker daemon (with its forked workers).

    `py-spy` is not a project dependency: install it anywhere (`pip install --target DIR py-spy`)
    and pass its path. Writes collapsed stacks (`*.txt`, one line per stack with its sample
    count) into `out_dir`; `top_frames()` summarizes them.
    """

    def __init__(self, py_spy: str, out_dir: Path, rate: int = 50):
        self.py_spy, self.out_dir, self.rate = py_spy, Path(out_dir), rate
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("driver.txt", "workers.txt"):  # never report a previous run's profile
            (self.out_dir / stale).unlink(missing_ok=True)
        self.procs: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def _record(self, pid: int, name: str, subprocesses: bool = False) -> None:
        cmd = [self.py_spy, "record", "--pid", str(pid), "--rate", str(self.rate), "--format", "raw",
               "--output", str(self.out_dir / f"{name}.txt"), "--nonblocking"]
        if subprocesses:
            cmd.append("--subprocesses")
        self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def start(self, driver_pid: int, jvm: int | None) -> None:
        self._record(driver_pid, "driver")
        if jvm:
            self._watcher = threading.Thread(target=self._watch_workers, args=(jvm,), daemon=True)
            self._watcher.start()

    def _watch_workers(self, jvm: int) -> None:
        """The worker daemon starts with the first Python task: attach as soon as it appears."""
        while not self._stop.is_set():
            for pid in _children(jvm):
                with contextlib.suppress(OSError):
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    if b"pyspark.daemon" in cmdline or b"entity_assets.spark_daemon" in cmdline:
                        self._record(pid, "workers", subprocesses=True)
                        return
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        for p in self.procs:
            p.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def top_frames(collapsed: Path, limit: int = 25, *, own: bool = True,
               contains: str | None = None) -> list[tuple[str, float]]:
    """Share of samples per function from py-spy's raw (collapsed) output.

    own=True: the innermost frame (where the time is spent); own=False: inclusive time of
    every frame, or of the frames whose text holds `contains` (e.g. "entity_assets/").
    """
    from collections import Counter

    counts: Counter = Counter()
    total = 0
    for line in Path(collapsed).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = [f for f in stack.split(";") if f and not f.startswith("process ")]
        if not frames:
            continue
        total += int(n)
        if own:
            counts[frames[-1]] += int(n)
        else:
            for f in set(frames):
                if contains is None or contains in f:
                    counts[f] += int(n)
    return [(f, c / total) for f, c in counts.most_common(limit)] if total else []


def print_profile(out_dir: Path) -> None:
    """The top of the driver's and the workers' profiles: own time, then the project's functions."""
    for name in ("driver", "workers"):
        path = Path(out_dir) / f"{name}.txt"
        if path.exists():
            print(f"\nprofile of the {name} (share of samples; collapsed stacks in {path})")
            print("  own time:")
            for frame, share in top_frames(path, 15):
                print(f"  {share:6.1%}  {frame}")
            print("  inclusive time of the project's functions:")
            for frame, share in top_frames(path, 15, own=False, contains="entity_assets/"):
                print(f"  {share:6.1%}  {frame}")
