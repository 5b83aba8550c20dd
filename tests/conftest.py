"""Shared fixtures: one real broker and one SparkSession per test session, one isolated pipeline per test.

    broker      a local Kafka-protocol broker (noida-db) on a free port, stopped at the end
    spark       a SparkResource on local[2]; its session (the JVM) starts once for the whole run
    pipeline    a fresh, isolated pipeline for one test (see `Pipeline`)
    make_pipeline   the same with other slicing settings: make_pipeline(max_messages=500)

A `Pipeline` has its own topic prefix on the shared broker, its own lake under tmp_path and its
own ephemeral Dagster instance, and drives the code location the way the daemon does: the
sensor from `defs` ticks with the cursor it returned last time, its dynamic partitions are
added to the instance, and runs execute the `slice_job` of `defs` (every asset registered
there, present and future) with the test's resources.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from dagster import AssetKey, DagsterInstance, Definitions, SensorResult, SkipReason, build_sensor_context

from entity_assets.assets import common
from entity_assets.assets.retries import RETRIES_VARIABLE
from entity_assets.broker import LocalBroker
from entity_assets.ingest import INPUT_STREAMS
from entity_assets.kafka_io import ensure_topics, produce
from entity_assets.local_service import free_port as free_port_on_loopback
from entity_assets.manifests import ManifestStore
from entity_assets.slices import Manifest
from entity_assets.tables import SCHEMAS
from resources import KafkaResource, LakeResource, SlicingResource, SparkResource, with_settings

PRODUCTION_SMALL_TASK_ROWS = common.SMALL_TASK_ROWS  # before make_pipeline changes it

JOB = "slice_job"
SENSOR = "kafka_offsets_sensor"
TOPIC_PARTITIONS = 4


SESSION_MARK = "PYTEST_REAPER_SESSION"
"""Not an ENTITY_ASSETS_ or DAGSTER_ variable: tests that start commands without those keep it."""


@pytest.fixture(scope="session", autouse=True)
def _reaper() -> Iterable[None]:
    """Marks the environment every process of this session inherits, for `tests/reaper.py` to end
    them all if pytest dies; first of the session's fixtures, so it is set before anything starts."""
    value = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != SESSION_MARK}
    reaper = subprocess.Popen([sys.executable, str(Path(__file__).with_name("reaper.py")), SESSION_MARK, value],
                              stdin=subprocess.PIPE, env=env, start_new_session=True)
    os.environ[SESSION_MARK] = value
    yield
    os.environ.pop(SESSION_MARK, None)
    reaper.communicate(b"done", timeout=30)


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory, _reaper):
    """Nothing a test does may touch the project's .entity-assets or the user's Dagster home.

    Steps are not retried (`assets.retries`): tests that make a step fail expect its run to fail;
    `test_a_step_that_fails_transiently_is_retried_within_its_run` turns retries on."""
    home = tmp_path_factory.mktemp("entity-assets-home")
    saved = {k: os.environ.get(k) for k in ("ENTITY_ASSETS_HOME", "ENTITY_ASSETS_LAKE", RETRIES_VARIABLE)}
    os.environ["ENTITY_ASSETS_HOME"] = str(home)
    os.environ.pop("ENTITY_ASSETS_LAKE", None)
    os.environ[RETRIES_VARIABLE] = "0"
    yield home
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _no_deployment_settings(monkeypatch):
    """A setting exported in the developer's shell, or set by a command an earlier test ran
    (`cli.prepare_environment`), would differ from a test's own resources, which runs refuse
    (`resources.deployed`): each test starts without them and sets its own, and leaves the
    environment as it found it (a variable a command set, never one monkeypatch knew of, too)."""
    from entity_assets.definitions import OTHER_VARIABLES, VARIABLES

    session_set = {"ENTITY_ASSETS_HOME", RETRIES_VARIABLE}  # by `_isolated_home`, for every test
    for variable in [*VARIABLES.values(), *(v for v in OTHER_VARIABLES if v not in session_set)]:
        monkeypatch.delenv(variable, raising=False)
    # pyspark's mark of a process whose sessions are Spark Connect's (`spark_connect.connect`):
    # left by one test, the next one's local session would be taken for a Connect one
    monkeypatch.delenv("SPARK_CONNECT_MODE_ENABLED", raising=False)
    found = dict(os.environ)
    yield
    for name in [n for n in os.environ if n not in found]:  # only what changed: other threads read it
        del os.environ[name]
    for name, value in found.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _delete_records_before(config: dict, offsets: dict[tuple[str, int], int]) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(config)  # held until the futures are done: they never complete once it is collected
    for future in admin.delete_records([TopicPartition(t, p, o) for (t, p), o in offsets.items()]).values():
        future.result()


@pytest.fixture
def delete_records_before() -> Callable[[dict, dict[tuple[str, int], int]], None]:
    """What Kafka's retention does: each partition's records before the offset are gone."""
    return _delete_records_before


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Gives TCP ports on 127.0.0.1 that nothing listens on, for servers a test starts."""
    return free_port_on_loopback


def _lake_rows(lake: LakeResource) -> dict[str, list[str]]:
    engine = lake.open()
    return {t: sorted(json.dumps(r, sort_keys=True, default=str) for r in engine.read(t).to_pylist())
            for t in SCHEMAS if engine.exists(t)}


@pytest.fixture
def lake_rows() -> Callable[[LakeResource], dict[str, list[str]]]:
    """Gives each table of a lake as its rows' sorted JSON texts, to compare two lakes; the slice
    manifests aside (they hold the wall-clock time their slice closed)."""
    return _lake_rows


@pytest.fixture
def project_instance(tmp_path, monkeypatch) -> Iterable[DagsterInstance]:
    """A Dagster instance on the project's own dagster.yaml (storage, pools, run monitoring, run
    launcher), in DAGSTER_HOME as the project's scripts make it."""
    (tmp_path / "dagster.yaml").write_text((Path(__file__).resolve().parents[1] / "dagster.yaml").read_text())
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    instance = DagsterInstance.from_config(str(tmp_path))
    yield instance
    instance.dispose()


@pytest.fixture(scope="session")
def broker(tmp_path_factory) -> Iterable[LocalBroker]:
    """A real local broker for the whole session; stopped by its pid (LocalBroker.stop) at the end."""
    local = LocalBroker(tmp_path_factory.mktemp("broker"), port=free_port_on_loopback())
    try:
        local.start(timeout=60)
    except Exception:
        log = local.data_dir / "broker.log"
        pytest.fail(f"local broker did not start: {log.read_text()[-2000:] if log.exists() else 'no log'}")
    yield local
    local.stop()


@pytest.fixture(scope="session")
def spark() -> Iterable[SparkResource]:
    """One SparkResource (and one JVM) per session.

    Dagster re-creates configured resources per run, but `SparkResource.session()` goes
    through `getOrCreate`, so every run of the session gets this same SparkSession.
    """
    resource = SparkResource(master="local[2]", app_name="entity-assets-tests",
                             conf={"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4"})
    session = resource.session()
    yield resource
    session.stop()


def _definitions():
    from entity_assets.definitions import defs

    return defs


class Pipeline:
    """An isolated copy of the pipeline on the shared broker and Spark (see the module docstring)."""

    _ids = itertools.count(1)

    def __init__(self, broker: LocalBroker, spark: SparkResource, root: Path, *, partitions: int = TOPIC_PARTITIONS,
                 max_messages: int = 5_000_000, max_messages_per_task: int = 1000, min_interval_seconds: float = 0,
                 state_file_rows: int | None = None, driver_rows: int = 0, instance=None, prefix: str | None = None,
                 lake_root: str | None = None, storage_options: dict[str, str] | None = None,
                 ingestion: dict | None = None, offsets_went_back: str = "report", schema_wait_slices: int = 4, parts_wait_slices: int = 96,
                 dedupe_window_slices: int = 4,
                 published_streams: list[str] | None = None):
        """`prefix`: another pipeline's, to read the same input topics (and publish to the same output
        topics); `lake_root` and `storage_options`: a lake elsewhere than under `root` (an object store);
        `ingestion`: the Kafka resource's CDC sources, instead of its default; `published_streams`: its
        streams to publish, instead of every one."""
        base = _definitions()
        self.prefix = prefix or f"t{next(self._ids)}."
        self.kafka = KafkaResource(bootstrap_servers=broker.bootstrap, topic_prefix=self.prefix,
                                   published_streams=published_streams,
                                   **({"ingestion": ingestion} if ingestion is not None else {}))
        self.lake = LakeResource(root=lake_root or str(root / "lake"), storage_options=storage_options or {},
                                 **({"state_file_rows": state_file_rows} if state_file_rows else {}))
        self.slicing = SlicingResource(min_interval_seconds=min_interval_seconds, max_messages=max_messages,
                                       max_messages_per_task=max_messages_per_task, offsets_went_back=offsets_went_back,
                                       schema_wait_slices=schema_wait_slices, parts_wait_slices=parts_wait_slices,
                                       dedupe_window_slices=dedupe_window_slices)
        # Small slices' work runs in the driver in production (SparkResource.driver_rows); tests
        # run it in Spark tasks unless they choose the driver, so both paths are exercised.
        self.spark = spark = with_settings(spark, driver_rows=driver_rows)
        # Resources bound in defs first (assets added later may need more), ours over them.
        self.resources: dict[str, Any] = {
            **(base.resources or {}),
            "spark": spark, "kafka": self.kafka, "lake": self.lake, "slicing": self.slicing,
        }
        # The code location's own assets, checks, jobs and sensors, bound to this pipeline's resources.
        self.defs = Definitions(
            assets=base.assets, asset_checks=base.asset_checks, jobs=base.jobs, sensors=base.sensors,
            schedules=base.schedules, executor=base.executor, loggers=base.loggers, resources=self.resources,
        )
        self.instance = instance or DagsterInstance.ephemeral()
        self.cursor: str | None = None
        self.last_result = None
        ensure_topics(self.kafka.config(), [self.topic(s) for s in INPUT_STREAMS], partitions)

    # -- Kafka
    def topic(self, stream: str) -> str:
        return self.kafka.topic(stream)

    def produce(self, records: Iterable[tuple[str, str | bytes | None, bytes | str]]) -> Counter:
        """Produces (stream, key, value) records (as entity_assets.samples makes them); counts per stream."""
        by_stream: dict[str, list] = {}
        for stream, key, value in records:
            by_stream.setdefault(stream, []).append((key, value))
        return Counter({s: produce(self.kafka.config(), self.topic(s), items) for s, items in by_stream.items()})

    def end_offsets(self, stream: str = "entity-batches") -> dict[tuple[str, int], int]:
        return self.kafka.end_offsets([self.topic(stream)])

    def consume(self, stream: str, timeout: float = 30.0) -> list[dict]:
        """Every record now on a stream's topic (inputs, or streams the assets publish), in offset order.

        Each as {partition, offset, key, value, timestamp}.
        """
        import time

        from confluent_kafka import Consumer, TopicPartition

        ends = {p: e for (_, p), e in self.end_offsets(stream).items() if e > 0}
        if not ends:
            return []
        consumer = Consumer({**self.kafka.config(), "group.id": f"tests-{self.prefix}", "enable.auto.commit": False})
        out: list[dict] = []
        try:
            consumer.assign([TopicPartition(self.topic(stream), p, 0) for p in ends])
            remaining = dict(ends)
            deadline = time.monotonic() + timeout
            while remaining and time.monotonic() < deadline:
                for msg in consumer.consume(1000, timeout=0.2):
                    if msg.error() is not None or msg.partition() not in remaining:
                        continue
                    out.append({"partition": msg.partition(), "offset": msg.offset(), "key": msg.key(),
                                "value": msg.value(), "timestamp": msg.timestamp()[1]})
                    if msg.offset() >= remaining[msg.partition()] - 1:
                        del remaining[msg.partition()]
            if remaining:
                raise TimeoutError(f"{self.topic(stream)}: partitions {sorted(remaining)} not read to the end")
        finally:
            consumer.close()
        return sorted(out, key=lambda r: (r["partition"], r["offset"]))

    # -- Dagster
    def tick(self) -> list:
        """One sensor evaluation, as the daemon does it; returns the run requests.

        Keeps the cursor the sensor returned for the next tick and applies the sensor's dynamic
        partition requests to the instance. `last_result` holds the whole SensorResult.
        """
        sensor = self.defs.resolve_sensor_def(SENSOR)
        with build_sensor_context(instance=self.instance, cursor=self.cursor, resources=self.resources,
                                  sensor_name=SENSOR) as context:
            result = sensor(context)
            if not isinstance(result, SensorResult):  # SkipReason, None, or RunRequests
                requests = [] if result is None or isinstance(result, SkipReason) else list(result)
                result = SensorResult(run_requests=requests, skip_reason=result if isinstance(result, SkipReason)
                                      else None, cursor=context.cursor)
        self.last_result = result
        for event in result.asset_events:  # the daemon stores them
            self.instance.report_runless_asset_event(event)
        if result.cursor is not None:
            self.cursor = result.cursor
        for request in result.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        for request in result.run_requests or []:  # what `run_request` takes for granted, as the daemon would not
            assert request.job_name in (None, JOB) and request.asset_selection is None, request
        return list(result.run_requests or [])

    def run(self, partition_key: str, *, assets: Iterable[str | AssetKey] | None = None,
            raise_on_error: bool = True, tags: dict | None = None):
        """Materializes one slice through `slice_job` of defs, as the daemon's run would.

        Every asset of the job by default; `assets` selects a subset of the job (a multi-asset
        that cannot subset needs all its keys, see `asset_keys_of`).
        """
        selection = None if assets is None else [AssetKey.from_coercible(a) for a in assets]
        job = self.defs.resolve_job_def(JOB)
        return job.execute_in_process(partition_key=partition_key, instance=self.instance,
                                      asset_selection=selection, raise_on_error=raise_on_error, tags=tags)

    def asset_keys_of(self, asset: str | AssetKey) -> list[AssetKey]:
        """Every key of the assets definition that materializes `asset` (all outputs of a multi-asset)."""
        return sorted(self.defs.resolve_assets_def(AssetKey.from_coercible(asset)).keys)

    def run_request(self, request, **kwargs):
        """Runs a sensor's RunRequest the way the daemon would (its partition, tags and run key)."""
        tags = {**(request.tags or {}), **({"dagster/run_key": request.run_key} if request.run_key else {})}
        return self.run(request.partition_key, tags=tags, **kwargs)

    def tick_and_run(self) -> list:
        """A tick, then every requested slice in order; returns the run results."""
        return [self.run_request(r) for r in self.tick()]

    # -- lake
    @property
    def engine(self):
        return self.lake.open()

    def read(self, table: str, version: int | None = None) -> pa.Table:
        """The current (or `version`) snapshot of a lake table."""
        return self.engine.read(table, version=version)

    def manifest(self, key: str | int) -> Manifest:
        return ManifestStore(self.engine).get(key)

    @staticmethod
    def materializations(result) -> dict[str, dict[str, Any]]:
        """Asset key -> {metadata name: plain value} of the materializations of one in-process run."""
        out = {}
        for event in result.get_asset_materialization_events():
            mat = event.event_specific_data.materialization
            out[mat.asset_key.to_user_string()] = {k: getattr(v, "value", v) for k, v in mat.metadata.items()}
        return out

    @staticmethod
    def observations(result) -> dict[str, dict[str, Any]]:
        """Asset key -> {metadata name: plain value} of the observations one in-process run logged
        (the messages of the slice on each topic published to: `kafka/entity-patches`)."""
        out = {}
        for event in result.get_asset_observation_events():
            observation = event.event_specific_data.asset_observation
            out[observation.asset_key.to_user_string()] = {k: getattr(v, "value", v)
                                                            for k, v in observation.metadata.items()}
        return out

    @staticmethod
    def checks(result) -> dict[str, Any]:
        """Check name -> its evaluation (`passed`, `metadata`) in one in-process run."""
        return {e.check_name: e for e in result.get_asset_check_evaluations()}

    @staticmethod
    def failure_text(event) -> str:
        """A step failure event's message with all its causes."""
        parts, error = [], event.event_specific_data.error
        while error is not None:
            parts.append(error.message)
            error = error.cause
        return "\n".join(parts)


@pytest.fixture
def make_pipeline(broker, spark, tmp_path, monkeypatch):
    # As large slices do, split each step's work over several tasks (bucket folds: up to 2 per
    # core), so that no test passes only because one task saw every row.
    monkeypatch.setattr(common, "SMALL_TASK_ROWS", 1)
    made = []

    def make(*, production_layout: bool = False, **kwargs) -> Pipeline:
        """`production_layout`: small work in the driver and one task for a small slice, as in
        production, instead of every step's work in Spark tasks split over several."""
        if production_layout:
            monkeypatch.setattr(common, "SMALL_TASK_ROWS", PRODUCTION_SMALL_TASK_ROWS)
            kwargs.setdefault("driver_rows", SparkResource().driver_rows)
        p = Pipeline(broker, spark, tmp_path / f"p{len(made)}", **kwargs)
        made.append(p)
        return p

    yield make
    for p in made:
        p.instance.dispose()


@pytest.fixture
def pipeline(make_pipeline) -> Pipeline:
    return make_pipeline()


@pytest.fixture
def worker_daemons():
    """The Python worker daemons a Spark server started (its children running
    entity_assets.spark_daemon), by the server's pid: one per session it served tasks in."""
    def daemons(server_pid: int) -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                ppid = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
                if ppid == server_pid and b"spark_daemon" in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except (OSError, ValueError):
                continue
        return found
    return daemons


@pytest.fixture
def running():
    """A process whose command line holds `arguments`, once it runs: a process's command line may
    read empty for a moment after its start (gVisor). Ended with the test."""
    started = []

    def start(*arguments: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)", *arguments],
                                stdout=subprocess.PIPE)
        started.append(proc)
        proc.stdout.readline()
        proc.stdout.close()
        return proc
    yield start
    for proc in started:
        proc.kill()
        proc.wait()
