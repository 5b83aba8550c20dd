"""Servers the project starts and stops itself on 127.0.0.1: the broker and the Spark Connect server.

Each runs detached from the command that started it (it outlives a demo or a `dagster dev`),
with its pid file and log in its own folder under the project home, and is stopped by that pid:
SIGTERM, waited for so it can save, then SIGKILL after a timeout, waited for too (a start right
after must find the port free). Starts and stops of one folder take turns (a lock file there):
two `scripts/ui.sh` at once would otherwise both launch a server, and the one whose server lost
the port would stop the other's.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 on), for a local server started
    later: one the kernel gave out could be taken by an outgoing connection (a Kafka client's,
    Spark's) before the server binds it, and one handed out already is not again."""
    for port in random.SystemRandom().sample(range(20_000, 32_000), 200):  # not the seeded global one
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port in 20000-31999")


class PortInUse(RuntimeError):
    """Another process listens on the service's port: the operator's to stop, or to pick another."""


class NotInstalled(RuntimeError):
    """The service's program is not installed: an extra of the package brings it."""


class NotReady(RuntimeError):
    """The server exited at its start, or did not answer in time: its log says why."""


PROC = Path("/proc")
"""Linux's process table; without it (macOS) a command line comes from `ps`."""


def _arguments(pid: int) -> list[str] | None:
    """A process's command line: /proc's, or where there is none (macOS) `ps`'s, split at blanks;
    None when neither tells (the process is gone, or not ours to see)."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        pass
    try:
        said = subprocess.run(["ps", "-ww", "-o", "command=", "-p", str(pid)],  # -ww: not cut at 80 columns
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return said.stdout.split() or None


def _listener(port: int) -> int | None:
    """The pid of a process of this user that listens on `port` (Linux's /proc: the socket's inode,
    then the process with it among its descriptors); None where it cannot be told."""
    sockets = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... inode
            if fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:  # 0A: LISTEN
                sockets.add(f"socket:[{fields[9]}]")
    for descriptor in PROC.glob("[0-9]*/fd/*") if sockets else ():  # another user's are not listed
        try:
            if os.readlink(descriptor) in sockets:
                return int(descriptor.parts[-3])
        except OSError:
            continue
    return None


def write_file(path: Path, text: str) -> None:
    """Replaces `path` at once (a reader never sees it half written), readable by its owner only."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


KILLED_WAIT = 5.0
"""Seconds a stop waits for a server to be gone after SIGKILL, which the kernel carries out at once
unless the process is stuck in the kernel (a hung disk)."""


def _exited(pid: int, timeout: float) -> bool:
    """Waits up to `timeout` seconds for `pid` to exit; reaps it where this process is its parent."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _end(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Ends a server this process launched: SIGTERM, then SIGKILL after `timeout`."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class LocalService:
    data_dir: Path
    port: int
    host: str = "127.0.0.1"

    name: ClassVar[str]
    program: ClassVar[str]
    """A part of the server process's command line that names its program: a pid file whose
    process lacks it is stale (a reboot, a crash), its pid another process's now."""

    def __post_init__(self) -> None:
        # one spelling of the folder, the one its server's command line names (`folder_argument`):
        # scripts give the home as the shell's logical $PWD, a command without it as the real one
        object.__setattr__(self, "data_dir", Path(os.path.realpath(self.data_dir)))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.data_dir / f"{self.name}.log"

    @property
    def fingerprint_file(self) -> Path:
        return self.data_dir / f"{self.name}.fingerprint"

    @property
    def folder_argument(self) -> str | None:
        """An argument of the server's command line that names this folder: another home's server (on
        the same default port) is not this one's, whatever a stale pid file says. None: its command
        names no folder (the object stores, on ports of their own)."""
        return None

    def of_this_folder(self, pid: int, arguments: list[str]) -> bool:
        """Whether the server `pid`, whose command line is `arguments`, is this folder's."""
        argument = self.folder_argument
        return argument is None or f" {argument} " in f" {' '.join(arguments)} "  # `ps`'s is split at blanks

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        return None

    def fingerprint(self) -> str | None:
        """What the server runs that its start fixes (the code it loads), recorded at its start; None:
        nothing a start must follow."""
        return None

    def prepare(self) -> None:
        """Writes what the server reads at its start, before it launches."""
        if (fingerprint := self.fingerprint()) is not None:
            write_file(self.fingerprint_file, fingerprint)

    def outdated(self) -> bool:
        """Whether the running server started on other code than this process's (an upgrade since)."""
        fingerprint = self.fingerprint()
        try:
            return fingerprint is not None and self.fingerprint_file.read_text() != fingerprint
        except FileNotFoundError:  # started by a release that recorded none
            return True

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
        """The server's pid, if it runs (this folder's: never another home's). One on another port than
        this one's raises PortInUse."""
        try:
            pid = int(self.pid_file.read_text())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            return None
        arguments = _arguments(pid)
        if arguments is None or not any(self.program in a for a in arguments) or not self.of_this_folder(pid, arguments):
            return None  # stale, another home's, or cannot tell: never signal it
        if not any(a == str(self.port) or a.endswith(f"={self.port}") for a in arguments):
            raise PortInUse(f"the {self.name} of {self.data_dir} runs with pid {pid} on another port than "
                            f"{self.port}: stop it first (same settings as its start), or use its port")
        return pid

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """This folder's server to this process alone until the block ends: other starts and stops wait."""
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # its log may name what a failure said
        with open(self.data_dir / f"{self.name}.lock", "a") as lock:  # not inherited by the server
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def start(self, timeout: float = 60.0) -> int:
        """Starts the server detached from this process (a no-op if it runs, a restart if it is
        outdated); returns its pid."""
        with self._turn():
            running = self.pid()
            if running and not self.outdated():
                self.wait_ready(timeout)
                return running
            if running:
                print(f"{self.name}: the server running (pid {running}) started on other code than this install's: "
                      "restarting it", file=sys.stderr)
                self._stop()
            if self.listening():  # ours would not bind, and a probe would take the other for it
                holder = _listener(self.port)
                which = f"pid {holder}" if holder else f"`ss -ltnp 'sport = :{self.port}'` names it"
                raise PortInUse(f"{self.address} is in use by a process that {self.pid_file} does not name ({which}): "
                                f"stop it, or give this {self.name} another port")
            self.prepare()
            # the child keeps its own descriptor; the log is the user's alone, as its folder
            with open(os.open(self.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as log:
                proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, env=self.environment())
            try:
                write_file(self.pid_file, str(proc.pid))
                self.wait_ready(timeout, proc)
            except BaseException:  # its own server only: the pid file names no other while this holds the turn
                _end(proc)
                self.pid_file.unlink(missing_ok=True)
                raise
            return proc.pid

    def wait_ready(self, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
        """Waits for the server to answer; with `proc`, for this start's own server, which must still
        run after the probe that answered: the answer is then its, not another's on the port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = self.ready()
            if proc is not None and proc.poll() is not None:
                raise NotReady(f"{self.name} exited with {proc.returncode}{self._last_lines()}")
            if ready:
                return
            time.sleep(0.2)
        raise NotReady(f"{self.name} on {self.address} not ready after {timeout:g} s{self._last_lines()}")

    def _last_lines(self, lines: int = 5, tail: int = 8192) -> str:
        """The log's last lines, read from its end: a server's log may be long."""
        try:
            with open(self.log_file, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - tail))
                said = log.read().decode(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            said = []
        return f"; the end of {self.log_file}:\n  " + "\n  ".join(said) if said else f"; see {self.log_file}"

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM and wait; returns whether one was running. A start in progress finishes first."""
        if not self.data_dir.is_dir():  # never started here
            return False
        with self._turn():
            return self._stop(timeout)

    def _stop(self, timeout: float = 30.0) -> bool:
        pid = self.pid()
        if pid is not None:
            for sent, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, KILLED_WAIT)):
                try:
                    os.kill(pid, sent)
                except ProcessLookupError:  # exited since its pid was read
                    break
                if _exited(pid, wait):
                    break
        self.pid_file.unlink(missing_ok=True)
        return pid is not None

    def status(self) -> dict:
        return {"address": self.address, "pid": self.pid(), "data_dir": str(self.data_dir)}

    def __str__(self) -> str:
        return json.dumps(self.status())
