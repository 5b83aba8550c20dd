"""The test session's reaper (tests/reaper.py): what pytest started ends with pytest, even a killed one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REAPER = Path(__file__).with_name("reaper.py")

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the reaper reads /proc")


def _session(mark: str) -> tuple[subprocess.Popen, subprocess.Popen, subprocess.Popen]:
    """A reaper, a detached process of its session, and one of another session."""
    clean = {k: v for k, v in os.environ.items() if k != "REAPER_TEST"}
    reaper = subprocess.Popen([sys.executable, str(REAPER), "REAPER_TEST", mark], stdin=subprocess.PIPE, env=clean)
    ours = subprocess.Popen(["sleep", "60"], env={**clean, "REAPER_TEST": mark}, start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], env={**clean, "REAPER_TEST": mark + "x"}, start_new_session=True)
    return reaper, ours, other


def test_a_dead_session_s_processes_are_ended_and_no_other():
    reaper, ours, other = _session("a1")
    try:
        reaper.stdin.close()  # what pytest's death does to the pipe
        assert reaper.wait(30) == 0
        assert ours.wait(5) == -signal.SIGTERM
        assert other.poll() is None
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


def test_a_normal_end_ends_nothing():
    reaper, ours, other = _session("b2")
    try:
        reaper.communicate(b"done", timeout=30)
        assert reaper.returncode == 0 and ours.poll() is None and other.poll() is None
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()
