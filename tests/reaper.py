"""Ends what a test session started when pytest itself dies (SIGKILL, an out-of-memory kill, a CI
job's time limit): the servers run detached, in sessions of their own, and nothing else would stop them.

conftest starts it with its stdin a pipe from pytest. `done` on that pipe is a normal end: it exits.
End of file alone means pytest is gone: it signals every process whose environment carries the
session's mark (whatever pytest started inherits it, through the CLI and the scripts too),
SIGTERM first so a broker saves its data, then SIGKILL to what is left after a grace period.
Linux only (it reads /proc); elsewhere it exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

GRACE_SECONDS = 15


def marked(mark: bytes) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                pass
    return pids


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def main(name: str, value: str) -> int:
    said = sys.stdin.buffer.read()
    if said == b"done" or not Path("/proc/self/environ").exists():
        return 0
    mark = f"{name}={value}".encode()
    signal_all(marked(mark), signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    signal_all(left, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
