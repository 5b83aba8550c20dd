"""Starting and stopping the project's local servers (entity_assets/local_service.py), on a small
Python server that listens on its port: starts at once launch one server, a failed start ends
its own server only, an outdated server is restarted, and a pid is trusted only when the
process's command line says it is the server."""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from entity_assets import local_service
from entity_assets.local_service import LocalService, NotReady

LISTEN = """import socket, sys, time
print("started", flush=True)
time.sleep(float(sys.argv[3]))
server = socket.create_server(("127.0.0.1", int(sys.argv[2])))
time.sleep(600)"""


@dataclass(frozen=True)
class Listener(LocalService):
    """Listens on its port `delay` seconds after it starts; runs `code`."""

    delay: float = 0.0
    code: str | None = None
    name, program = "listener", "entity-assets-test-listener"

    def command(self) -> list[str]:
        return [sys.executable, "-c", LISTEN, self.program, str(self.port), str(self.delay)]

    def ready(self) -> bool:
        return self.listening()

    def fingerprint(self) -> str | None:
        return self.code


def _alive(pid: int) -> bool:
    return local_service._arguments(pid) is not None


def test_two_starts_at_once_launch_one_server_and_both_return_it(tmp_path, free_port):
    """Two `scripts/ui.sh` at once: without taking turns, both would launch, and the one whose
    server could not bind would stop the pid file's, the other's."""
    server = Listener(tmp_path / "home", port=free_port(), delay=1.0)
    try:
        with ThreadPoolExecutor(2) as pool:
            pids = [f.result() for f in [pool.submit(server.start, 30) for _ in range(2)]]
        assert pids[0] == pids[1] == server.pid() and _alive(pids[0])
        assert server.log_file.read_text().count("started") == 1
        # what a failure said may be in the log: the user's alone, as its folder
        assert (server.data_dir.stat().st_mode & 0o777, server.log_file.stat().st_mode & 0o777) == (0o700, 0o600)
    finally:
        server.stop()


def test_an_outdated_server_is_restarted_and_a_current_one_kept(tmp_path, free_port):
    port = free_port()
    first = Listener(tmp_path, port=port, code="1.0").start(timeout=30)
    try:
        assert Listener(tmp_path, port=port, code="1.0").start(timeout=30) == first
        second = Listener(tmp_path, port=port, code="1.1").start(timeout=30)
        assert second != first and not _alive(first) and Listener(tmp_path, port=port).pid() == second
    finally:
        Listener(tmp_path, port=port).stop()


def test_a_pid_file_that_cannot_be_written_ends_the_server_it_named(tmp_path, free_port, monkeypatch):
    """A full disk at the pid file: the server it would name must not run on, unknown to `stop`."""
    written = local_service.write_file

    def full(path, text):
        if path.suffix == ".pid":
            raise OSError(errno.ENOSPC, "No space left on device")
        written(path, text)

    monkeypatch.setattr(local_service, "write_file", full)
    launched = []
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: launched.append(popen(*a, **k)) or launched[-1])
    server = Listener(tmp_path, port=free_port())
    with pytest.raises(OSError, match="No space left"):
        server.start(timeout=30)
    assert launched[0].poll() is not None and not server.pid_file.exists()


def test_a_start_is_ready_only_while_its_own_server_runs(tmp_path, free_port, monkeypatch):
    """A probe that another server answered while this start's own exited is no start."""
    monkeypatch.setattr(Listener, "command",
                        lambda self: [sys.executable, "-c", "import sys; sys.exit(3)", self.program])

    def answered_once_it_exited(self) -> bool:  # another server's answer, given after the start's own exited
        stat = Path(f"/proc/{self.pid_file.read_text()}/stat")
        deadline = time.monotonic() + 30
        while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        return True

    monkeypatch.setattr(Listener, "ready", answered_once_it_exited)
    server = Listener(tmp_path, port=free_port())
    with pytest.raises(NotReady, match="exited with 3"):
        server.start(timeout=30)
    assert not server.pid_file.exists()


def test_a_server_whose_folder_was_deleted_is_named_by_its_pid(tmp_path, free_port, monkeypatch):
    """`rm -rf .entity-assets` while the broker runs: every later start stopped at the port, naming
    no process to stop."""
    server = Listener(tmp_path / "home", port=free_port())
    pid = server.start(timeout=30)
    try:
        server.pid_file.unlink()
        with pytest.raises(local_service.PortInUse, match=rf"does not name \(pid {pid}\): stop it"):
            server.start(timeout=30)
        monkeypatch.setattr(local_service, "PROC", tmp_path / "no-proc")  # macOS: what finds it
        with pytest.raises(local_service.PortInUse, match=rf"\(`ss -ltnp 'sport = :{server.port}'` names it\)"):
            server.start(timeout=30)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


STUBBORN = """import signal, socket, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
server = socket.create_server(("127.0.0.1", int(sys.argv[2])))
time.sleep(600)"""


def test_a_stop_waits_for_a_killed_server_to_be_gone(tmp_path, free_port, monkeypatch):
    """A server that outlives SIGTERM's wait is killed: the stop returned at once, and a start right
    after found its port still open."""
    monkeypatch.setattr(Listener, "command", lambda self: [sys.executable, "-c", STUBBORN, self.program, str(self.port)])
    server = Listener(tmp_path, port=free_port())
    pid = server.start(timeout=30)
    assert server.stop(timeout=0.5) is True
    assert not _alive(pid) and not server.listening() and not server.pid_file.exists()


def test_a_server_that_exits_before_its_signal_is_stopped(running, tmp_path, monkeypatch):
    """It exited between the read of its pid and SIGTERM: the stop failed with "No such process",
    leaving its pid file."""
    server = Listener(tmp_path, port=29558)
    listener = running(server.program, "29558")
    server.pid_file.write_text(str(listener.pid))
    kill = os.kill

    def exited(pid, sent):
        if sent == signal.SIGTERM:
            raise ProcessLookupError(3, "No such process")
        kill(pid, sent)

    monkeypatch.setattr(os, "kill", exited)
    assert server.stop() is True and not server.pid_file.exists()


def test_the_end_of_a_long_log_is_read_from_its_end(tmp_path, free_port, monkeypatch):
    """A server's log of months (gigabytes) was read whole to show its last five lines."""
    server = Listener(tmp_path, port=free_port())
    with open(server.log_file, "wb") as log:
        log.truncate(2 * 1024**3)  # sparse: 2 GB that take no disk, and no time, unless read whole
        log.seek(0, 2)
        log.write(b"INFO noise\n" * 1_000)
    failing = "import sys; print('Error: no Java'); sys.exit(3)"
    monkeypatch.setattr(Listener, "command", lambda self: [sys.executable, "-c", failing, self.program])
    with pytest.raises(NotReady, match=r"exited with 3; the end of .*:\n(  INFO noise\n){4}  Error: no Java$"):
        server.start(timeout=30)


def test_without_proc_the_command_line_comes_from_ps_and_an_unknown_one_is_stale(running, tmp_path, monkeypatch):
    """macOS has no /proc: a pid file's live pid is the server's only if `ps` says so (here a `ps`
    that reads /proc for the test, as macOS's prints a command line: a container may have none)."""
    monkeypatch.setattr(local_service, "PROC", tmp_path / "no-proc")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "ps").write_text('#!/bin/sh\n# ps -ww -o command= -p PID\ntr "\\0" " " < /proc/"$5"/cmdline\n')
    (tools / "ps").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    server = Listener(tmp_path, port=29557)
    other = subprocess.Popen(["sleep", "60"])
    listener = running(server.program, "29557")
    try:
        server.pid_file.write_text(str(other.pid))
        assert server.pid() is None and server.stop() is False and other.poll() is None
        server.pid_file.write_text(str(listener.pid))
        assert server.pid() == listener.pid
        monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no `ps` either: cannot tell, so not the server's
        assert server.pid() is None
    finally:
        for proc in (other, listener):
            proc.kill()
            proc.wait()
