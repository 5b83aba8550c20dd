"""The embedded local broker: a Kafka-protocol server (noida-db) on 127.0.0.1.

Started and stopped by the project's own commands with its data under the project home, so
the demo and the tests need nothing installed by hand. A real cluster replaces it through the
Kafka resource's settings alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT = 29092
"""Below Linux's ephemeral ports (32768-60999 by default), which the kernel gives to outgoing
connections: right after a busy test run one of those may still hold a port in that range."""


def _binary() -> Path:
    import noida_db

    return Path(noida_db.__file__).parent / "noida-db"


@dataclass(frozen=True)
class LocalBroker:
    data_dir: Path
    port: int = DEFAULT_PORT
    host: str = "127.0.0.1"

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text())
            os.kill(pid, 0)
            return pid
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            return None

    def start(self, timeout: float = 60.0) -> int:
        """Starts the broker detached from this process (a no-op if it runs); returns its pid."""
        running = self.pid()
        if running:
            self.wait_ready(timeout)
            return running
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "broker.log", "ab")
        proc = subprocess.Popen(
            [str(_binary()), "start", "--data-dir", str(self.data_dir / "data"), "--only", "kafka",
             "--kafka-port", str(self.port), "--host", self.host],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self.pid_file.write_text(str(proc.pid))
        try:
            self.wait_ready(timeout, proc)
        except Exception:
            self.stop()
            raise
        return proc.pid

    def wait_ready(self, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"broker exited with {proc.returncode}; see {self.data_dir / 'broker.log'}")
            try:
                if admin.list_topics(timeout=1).brokers:
                    return
            except Exception:
                time.sleep(0.2)
        raise TimeoutError(f"broker on {self.bootstrap} not ready after {timeout}s")

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM and wait, so the broker saves its data; returns whether one was running.

        This process's idle producers end first: they would retry connecting until it exits.
        """
        from entity_assets.kafka_io import release_producers

        release_producers()
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)  # reap when we are the parent
                if done == pid:
                    break
            except ChildProcessError:
                pass
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)
        return True

    def status(self) -> dict:
        return {"bootstrap": self.bootstrap, "pid": self.pid(), "data_dir": str(self.data_dir)}

    def __str__(self) -> str:
        return json.dumps(self.status())
