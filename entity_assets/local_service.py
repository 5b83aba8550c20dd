"""Servers the project starts and stops itself on 127.0.0.1: the broker and the Spark Connect server.

Each runs detached from the command that started it (it outlives a demo or a `dagster dev`),
with its pid file and log in its own folder under the project home, and is stopped by that pid:
SIGTERM, waited for so it can save, then SIGKILL after a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


class PortInUse(RuntimeError):
    """Another process listens on the service's port: the operator's to stop, or to pick another."""


class NotInstalled(RuntimeError):
    """The service's program is not installed: an extra of the package brings it."""


class NotReady(RuntimeError):
    """The server exited at its start, or did not answer in time: its log says why."""


def _arguments(pid: int) -> list[str] | None:
    """A process's command line; None where /proc does not tell (not Linux)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None


@dataclass(frozen=True)
class LocalService:
    data_dir: Path
    port: int
    host: str = "127.0.0.1"

    name: ClassVar[str]
    program: ClassVar[str]
    """A part of the server process's command line that names its program: a pid file whose
    process lacks it is stale (a reboot, a crash), its pid another process's now."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.data_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        return None

    def ready(self) -> bool:
        """One probe: whether the server answers now."""
        raise NotImplementedError

    def listening(self) -> bool:
        """Whether anything accepts connections on the port."""
        try:
            with socket.create_connection((self.host, self.port), timeout=1):
                return True
        except OSError:
            return False

    def pid(self) -> int | None:
        """The server's pid, if it runs. One on another port than this one's raises PortInUse."""
        try:
            pid = int(self.pid_file.read_text())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            return None
        arguments = _arguments(pid)
        if arguments is None:
            return pid
        if not any(self.program in a for a in arguments):
            return None  # stale: never signal it
        if not any(a == str(self.port) or a.endswith(f"={self.port}") for a in arguments):
            raise PortInUse(f"the {self.name} of {self.data_dir} runs with pid {pid} on another port than "
                            f"{self.port}: stop it first (same settings as its start), or use its port")
        return pid

    def start(self, timeout: float = 60.0) -> int:
        """Starts the server detached from this process (a no-op if it runs); returns its pid."""
        running = self.pid()
        if running:
            self.wait_ready(timeout)
            return running
        if self.listening():  # ours would not bind, and a probe would take the other for it
            raise PortInUse(f"{self.address} is in use by a process that {self.pid_file} does not name: "
                               f"stop it, or give this {self.name} another port")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=self.environment())
        self.pid_file.write_text(str(proc.pid))
        try:
            self.wait_ready(timeout, proc)
        except Exception:
            self.stop()
            raise
        return proc.pid

    def wait_ready(self, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise NotReady(f"{self.name} exited with {proc.returncode}{self._last_lines()}")
            if self.ready():
                return
            time.sleep(0.2)
        raise NotReady(f"{self.name} on {self.address} not ready after {timeout:g} s{self._last_lines()}")

    def _last_lines(self, lines: int = 5) -> str:
        try:
            said = self.log_file.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            said = []
        return f"; the end of {self.log_file}:\n  " + "\n  ".join(said) if said else f"; see {self.log_file}"

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM and wait; returns whether one was running."""
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
        return {"address": self.address, "pid": self.pid(), "data_dir": str(self.data_dir)}

    def __str__(self) -> str:
        return json.dumps(self.status())
