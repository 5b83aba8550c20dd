"""The instance storage of dagster.yaml: Dagster's SQLite files, with connections kept per process."""

import contextlib
import os
import sqlite3
import time

import pytest
from dagster import AssetKey, AssetMaterialization, DagsterEventType, DagsterInstance, EventRecordsFilter
from dagster._core.events import DagsterEvent, StepMaterializationData
from dagster._core.events.log import EventLogEntry
from dagster._core.storage.event_log import SqliteEventLogStorage
from dagster._core.storage.event_log.sqlite import sqlite_event_log

from entity_assets import instance_storage
from entity_assets.instance_storage import (
    PooledSqliteEventLogStorage,
    PooledSqliteRunStorage,
    PooledSqliteScheduleStorage,
)

def _materialization(run_id: str, asset: str) -> EventLogEntry:
    event = DagsterEvent(DagsterEventType.ASSET_MATERIALIZATION.value, "slice_job", step_key="ingest",
                         event_specific_data=StepMaterializationData(AssetMaterialization(asset_key=asset)))
    return EventLogEntry(error_info=None, level=10, user_message="", run_id=run_id, timestamp=time.time(),
                         step_key="ingest", job_name="slice_job", dagster_event=event)


def _asset_runs(instance: DagsterInstance, asset: str) -> list[str]:
    records = instance.fetch_materializations(AssetKey(asset), limit=100).records
    return sorted(record.run_id for record in records)


@pytest.fixture
def home(tmp_path, project_instance):
    """The project's instance (its dagster.yaml) and its folder."""
    return project_instance, tmp_path


def test_the_project_instance_uses_the_pooled_storages(home):
    instance, _ = home
    assert isinstance(instance.event_log_storage, PooledSqliteEventLogStorage)
    assert isinstance(instance.run_storage, PooledSqliteRunStorage)
    assert isinstance(instance.schedule_storage, PooledSqliteScheduleStorage)


def test_events_land_in_dagsters_own_files(home):
    """An instance on Dagster's stock `storage: sqlite` over the same folder reads what the pooled one
    wrote, and the other way round: switching between them loses nothing."""
    instance, folder = home
    for n in range(3):
        instance.event_log_storage.store_event(_materialization(f"run-{n}", "entity_batches"))
    stock_home = folder / "stock-home"
    stock_home.mkdir()
    (stock_home / "dagster.yaml").write_text(f"storage:\n  sqlite:\n    base_dir: '{folder}'\n")
    stock = DagsterInstance.from_config(str(stock_home))
    try:
        assert type(stock.event_log_storage).__name__ == "SqliteEventLogStorage"
        assert _asset_runs(stock, "entity_batches") == ["run-0", "run-1", "run-2"]
        stock.event_log_storage.store_event(_materialization("run-stock", "entity_batches"))
    finally:
        stock.dispose()
    assert _asset_runs(instance, "entity_batches") == ["run-0", "run-1", "run-2", "run-stock"]
    assert (folder / "history" / "runs" / "run-0.db").exists() and (folder / "history" / "runs.db").exists()


def test_a_process_keeps_few_run_files_open(home, monkeypatch):
    """Engines are kept for the index and the latest run files; older ones are closed and reopened when used."""
    monkeypatch.setattr(instance_storage, "RUN_FILES_OPEN", 2)
    instance, folder = home
    storage = PooledSqliteEventLogStorage(str(folder / "history" / "runs"))
    try:
        for n in range(6):
            storage.store_event(_materialization(f"run-{n}", "entities"))
        assert len(storage._engines._engines) <= 3
        assert len(storage.get_logs_for_run("run-0")) == 1  # reopened
        records = storage.get_event_records(EventRecordsFilter(DagsterEventType.ASSET_MATERIALIZATION,
                                                               asset_key=AssetKey("entities")))
        assert sorted(r.run_id for r in records) == [f"run-{n}" for n in range(6)]
    finally:
        storage.dispose()


def test_a_forked_process_opens_its_own_connections(home, monkeypatch):
    instance, _ = home
    engines = instance.event_log_storage._engines
    instance.event_log_storage.store_event(_materialization("run-a", "entities"))
    before = dict(engines._engines)
    monkeypatch.setattr(engines, "_pid", -1)  # as a child sees its parent's pid
    instance.event_log_storage.store_event(_materialization("run-b", "entities"))
    assert not set(map(id, engines._engines.values())) & set(map(id, before.values()))
    assert _asset_runs(instance, "entities") == ["run-a", "run-b"]


def test_wipe_closes_the_run_files_it_deletes(home):
    instance, folder = home
    storage = instance.event_log_storage
    storage.store_event(_materialization("run-w", "entities"))
    storage.wipe()
    assert not (folder / "history" / "runs" / "run-w.db").exists()
    storage.store_event(_materialization("run-w", "entities"))
    assert (folder / "history" / "runs" / "run-w.db").exists()
    assert len(storage.get_logs_for_run("run-w")) == 1


def test_table_checks_use_the_index_engine(home, monkeypatch):
    instance, _ = home
    storage = instance.event_log_storage
    assert storage.has_table("dynamic_partitions") and not storage.has_table("no_such_table")
    for module in (instance_storage, sqlite_event_log):  # no new engine from here on
        monkeypatch.setattr(module, "create_engine", None)
    assert storage.has_table("dynamic_partitions") and not storage.has_table("no_such_table")
    instance.add_dynamic_partitions("slices", ["s1"])
    assert instance.has_dynamic_partition("slices", "s1")


def _layout(path) -> tuple:
    """A SQLite file's schema, alembic stamp and journal mode."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return (sorted(conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall()),
                conn.execute("SELECT version_num FROM alembic_version").fetchall(),
                conn.execute("PRAGMA journal_mode").fetchone())


def test_new_run_files_are_made_as_dagster_makes_them(home, tmp_path):
    """New run files are copies of a template; they match one made by Dagster's init."""
    instance, folder = home
    storage = instance.event_log_storage
    for run in ("run-1", "run-2", "run-3"):
        storage.store_event(_materialization(run, "entities"))
    stock = SqliteEventLogStorage(str(tmp_path / "stock"))
    stock.store_event(_materialization("run-0", "entities"))
    runs = folder / "history" / "runs"
    assert _layout(runs / "run-3.db") == _layout(runs / "run-1.db") == _layout(tmp_path / "stock" / "run-0.db")
    assert _layout(runs / "run-3.db")[2] == ("wal",)
    assert [len(storage.get_logs_for_run(r)) for r in ("run-1", "run-2", "run-3")] == [1, 1, 1]
    assert not [p for p in runs.iterdir() if p.name.endswith(".new")]


def test_a_run_file_another_process_made_first_is_kept(home, monkeypatch, tmp_path):
    """Between the copy and its link, another process (here Dagster's stock storage) makes the run's
    file and stores an event: the copy is dropped and the event stays."""
    instance, folder = home
    storage = instance.event_log_storage
    storage.store_event(_materialization("run-1", "entities"))  # the process's first: Dagster's init
    other = SqliteEventLogStorage(str(folder / "history" / "runs"))
    link = os.link

    def raced(src, dst):
        other.store_event(_materialization("run-2", "entity_updates"))
        link(src, dst)

    monkeypatch.setattr(instance_storage.os, "link", raced)
    storage.store_event(_materialization("run-2", "entities"))
    assert len(storage.get_logs_for_run("run-2")) == 2
    assert not [p for p in (folder / "history" / "runs").iterdir() if p.name.endswith(".new")]


def test_connections_at_once_are_not_capped(home):
    """The webserver answers queries in many threads: none waits for a pooled connection."""
    instance, _ = home
    storage = instance.run_storage
    with contextlib.ExitStack() as held:
        connections = [held.enter_context(storage.connect()) for _ in range(20)]
        assert len({id(c) for c in connections}) == 20


def test_a_stamped_run_file_is_opened_without_alembic(home, monkeypatch, tmp_path):
    """A run file another process made (the daemon creates a run, its worker writes it) is used as
    it is: Dagster's init would only load alembic's scripts to find it stamped."""
    instance, folder = home
    SqliteEventLogStorage(str(folder / "history" / "runs")).store_event(_materialization("run-1", "entities"))

    def no_alembic(*_):
        raise AssertionError("alembic loaded")

    monkeypatch.setattr(sqlite_event_log, "check_alembic_revision", no_alembic)
    instance.event_log_storage.store_event(_materialization("run-1", "entity_updates"))
    assert len(instance.event_log_storage.get_logs_for_run("run-1")) == 2


def test_without_hard_links_run_files_get_dagsters_init(home, monkeypatch):
    instance, _ = home

    def unsupported(*_):
        raise PermissionError("hard links not supported")

    monkeypatch.setattr(instance_storage.os, "link", unsupported)
    instance.event_log_storage.store_event(_materialization("run-1", "entities"))
    assert len(instance.event_log_storage.get_logs_for_run("run-1")) == 1


def _write_runs(home: str, worker: int, runs: int) -> None:
    os.environ["DAGSTER_HOME"] = home
    with DagsterInstance.from_config(home) as instance:
        for n in range(runs):
            for asset in ("entities", "entity_updates"):
                instance.event_log_storage.store_event(_materialization(f"w{worker}-run-{n}", asset))


def test_processes_writing_at_once_lose_nothing(home, tmp_path):
    """The daemon, the webserver and run workers share the files, each with its connections kept."""
    import multiprocessing

    instance, folder = home
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_write_runs, args=(str(folder), w, 15)) for w in range(3)]
    for p in workers:
        p.start()
    try:
        for p in workers:
            p.join(120)
        assert [p.exitcode for p in workers] == [0, 0, 0]
    finally:
        for p in workers:
            p.kill()  # one still writing, blocked on a lock: the assertion above has failed
            p.join()
    assert len(_asset_runs(instance, "entity_updates")) == 45
    assert all(len(instance.event_log_storage.get_logs_for_run(f"w{w}-run-{n}")) == 2
               for w in range(3) for n in range(15))
