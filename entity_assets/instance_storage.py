"""Dagster's SQLite instance storage, with each process keeping its database connections.

Dagster's SQLite storages build a SQLAlchemy engine, open the file and close it again for every
statement (`NullPool`): 6 ms of CPU per run event here, 11 ms for an asset event, which the
index shard gets too. A slice run stores about 120 events, so its bookkeeping cost more than a
small slice's Spark work. These subclasses keep one engine per database file and process
(a few run files at most, the least recently used closed); the files, their schema and WAL mode
are Dagster's own, so an instance can switch between this and `storage: sqlite` either way.
Postgres (`storage: postgres`) replaces all of it on a shared deployment.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dagster._core.storage.event_log import SqliteEventLogStorage
from dagster._core.storage.event_log.sqlite.sqlite_event_log import INDEX_SHARD_NAME
from dagster._core.storage.runs import SqliteRunStorage
from dagster._core.storage.schedules import SqliteScheduleStorage
from dagster._core.storage.sqlite import SQLITE_BUSY_TIMEOUT_SECONDS
from dagster._core.storage.sqlite_storage import (
    DagsterSqliteStorage,
    _event_logs_directory,
    _runs_directory,
    _schedule_directory,
)
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool, QueuePool

RUN_FILES_OPEN = 8
"""Run databases whose engine a process keeps; the webserver reads many runs, a run writes one."""


class _Engines:
    """Engines by database file for this process; a forked child starts with none of its parent's."""

    def __init__(self, timeout: float, limit: int | None = None):
        """`timeout`: seconds a statement waits for another process's write lock."""
        self._timeout, self._limit, self._engines, self._pid = timeout, limit, OrderedDict(), os.getpid()
        self._lock = threading.Lock()

    def get(self, key: str, conn_string: str) -> Engine:
        with self._lock:
            if self._pid != os.getpid():  # the parent's connections are its own (SQLite forbids sharing them)
                for engine in self._engines.values():
                    engine.dispose(close=False)
                self._engines, self._pid = OrderedDict(), os.getpid()
            engine = self._engines.get(key)
            if engine is not None:
                self._engines.move_to_end(key)
                return engine
            # one connection kept; more at once (the webserver's threads) are opened and closed as before
            engine = create_engine(conn_string, poolclass=QueuePool, pool_size=1, max_overflow=-1,
                                   connect_args={"timeout": self._timeout, "check_same_thread": False})
            self._engines[key] = engine
            if self._limit is not None and len(self._engines) > self._limit:
                _, oldest = self._engines.popitem(last=False)
                oldest.dispose()  # a connection still checked out closes when it is returned
            return engine

    def dispose(self) -> None:
        with self._lock:
            for engine in self._engines.values():
                engine.dispose()
            self._engines.clear()


def _stamped(path: str) -> bool:
    """Whether a SQLite file exists with an alembic stamp (Dagster's init then does nothing)."""
    if not os.path.exists(path):
        return False
    with contextlib.closing(sqlite3.connect(path, timeout=SQLITE_BUSY_TIMEOUT_SECONDS)) as conn:
        try:
            return conn.execute("SELECT version_num FROM alembic_version").fetchone() is not None
        except sqlite3.OperationalError:  # no such table: made by a process still in its init
            return False


class _RunFileTemplate:
    """An empty run file as Dagster's init makes it (tables, WAL mode, alembic stamp), made once
    per process in a private folder and held in memory; new run files are copies of it."""

    def __init__(self):
        self._lock, self._pid, self._db = threading.Lock(), 0, None

    def copy_to(self, path: str, init: Callable[[Engine], None]) -> bool:
        """Makes `path` a copy, linked into place only if no other process made the file
        meanwhile; False if it did not. `init` is Dagster's init, for the template."""
        with self._lock:
            if self._pid != os.getpid():
                self._db, self._pid = self._made_by(init), os.getpid()
            staged = f"{path}.{os.getpid()}.new"
            try:
                with contextlib.closing(sqlite3.connect(staged)) as copy:
                    self._db.backup(copy)
                    copy.execute("PRAGMA journal_mode=WAL")
                os.link(staged, path)  # fails if the file exists: another process made it meanwhile
                return True
            except (OSError, sqlite3.Error):  # that, or a file system without hard links: Dagster's init
                return False
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(staged)

    @staticmethod
    def _made_by(init: Callable[[Engine], None]) -> sqlite3.Connection:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "template.db")
            engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)
            init(engine)
            engine.dispose()
            db = sqlite3.connect(":memory:", check_same_thread=False)
            with contextlib.closing(sqlite3.connect(path)) as made:
                made.backup(db)
        return db


_RUN_FILE = _RunFileTemplate()


class PooledSqliteEventLogStorage(SqliteEventLogStorage):
    """`SqliteEventLogStorage` with the index's engine and the latest run files' kept open."""

    def __init__(self, base_dir: str, inst_data=None):
        # + the index shard; set before Dagster's init connects
        self._engines = _Engines(SQLITE_BUSY_TIMEOUT_SECONDS, limit=RUN_FILES_OPEN + 1)
        self._tables: set[str] = set()
        super().__init__(base_dir, inst_data)

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        return cls(inst_data=inst_data, **config_value)

    @contextmanager
    def _connect(self, shard: str) -> Iterator[Connection]:
        with self._db_lock:
            engine = self._engines.get(shard, self.conn_string_for_shard(shard))
            if shard not in self._initialized_dbs:
                self._initdb(engine)
                self._initialized_dbs.add(shard)
            with engine.connect() as conn, conn.begin():
                yield conn

    def _initdb(self, engine: Engine, for_index_shard: bool = False) -> None:
        # Dagster's init of a run file has alembic load its ~90 migration scripts, twice for a new
        # file (~130 ms), once to find an existing file stamped (~60 ms): each process that runs,
        # creates or shows a run pays it. A stamped file needs nothing; a new one is a copy.
        path = engine.url.database
        if not for_index_shard and path:
            if _stamped(path):
                return
            if not os.path.exists(path) and _RUN_FILE.copy_to(path, super()._initdb):
                return
        super()._initdb(engine, for_index_shard)

    def has_table(self, table_name: str) -> bool:
        # Dagster asks before writing an asset event's tags or a dynamic partition, each time with
        # an engine of its own; a table, once there, stays (only migrations add them)
        if table_name not in self._tables:
            engine = self._engines.get(INDEX_SHARD_NAME, self.conn_string_for_shard(INDEX_SHARD_NAME))
            with engine.connect() as conn:  # not `_connect`: callers may hold it
                if not engine.dialect.has_table(conn, table_name):
                    return False
            self._tables.add(table_name)
        return True

    def wipe(self) -> None:
        self._engines.dispose()  # Dagster deletes the run files: no connection may write to an unlinked one
        super().wipe()

    def dispose(self) -> None:
        super().dispose()
        self._engines.dispose()


class _OneFile:
    """`connect` through one engine kept by the process: Dagster's run and schedule storages."""

    _conn_string: str

    def __init__(self, conn_string: str, inst_data=None):
        self._engines = _Engines(5.0)  # sqlite3's default, as Dagster's engines for these files have
        super().__init__(conn_string, inst_data)

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        engine = self._engines.get("file", self._conn_string)
        with engine.connect() as conn, conn.begin():
            yield conn

    def dispose(self) -> None:
        super().dispose()
        self._engines.dispose()


class PooledSqliteRunStorage(_OneFile, SqliteRunStorage):
    """`SqliteRunStorage` with its engine kept open."""


class PooledSqliteScheduleStorage(_OneFile, SqliteScheduleStorage):
    """`SqliteScheduleStorage` (sensor ticks and cursors) with its engine kept open."""


class PooledSqliteStorage(DagsterSqliteStorage):
    """`storage: sqlite` with the pooled storages, in the same files:

        storage:
          custom:
            module: entity_assets.instance_storage
            class: PooledSqliteStorage
            config:
              base_dir: {env: DAGSTER_HOME}
    """

    def __init__(self, base_dir: str, inst_data=None):
        self.base_dir = base_dir
        self._run_storage = PooledSqliteRunStorage.from_local(_runs_directory(base_dir))
        self._event_log_storage = PooledSqliteEventLogStorage(_event_logs_directory(base_dir))
        self._schedule_storage = PooledSqliteScheduleStorage.from_local(_schedule_directory(base_dir))
        self._inst_data = inst_data
        super(DagsterSqliteStorage, self).__init__()

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        return cls.from_local(inst_data=inst_data, **config_value)
