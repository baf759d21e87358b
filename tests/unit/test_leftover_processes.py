"""The session-end check of tests/conftest.py: it finds the engines and routers this session started, and only those."""

import os
import subprocess
import sys
import time

from tests.conftest import SESSION_ENV, service_processes

# Named like a service on its command line (`-m stack.engine` after `-c`: arguments of the script), sleeping instead.
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)", "-m", "stack.engine"]


def _stopped(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(10)


def _until_found(pid: int, ancestor: int) -> dict[int, str]:
    """The services found once `pid` shows up: after a fork and before its exec, /proc shows the parent's command
    line (the bound only catches a child that never execs)."""
    deadline = time.monotonic() + 10
    while pid not in (found := service_processes(os.environ[SESSION_ENV], ancestor)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def test_a_service_this_session_started_is_found_until_it_stops() -> None:
    """A child carrying the session's mark is found; once it has exited it is not."""
    proc = subprocess.Popen(SLEEPER)
    try:
        found = _until_found(proc.pid, ancestor=os.getpid())
        assert proc.pid in found and "-m stack.engine" in found[proc.pid]
    finally:
        _stopped(proc)
    assert proc.pid not in service_processes(os.environ[SESSION_ENV], os.getpid())


def test_an_orphan_is_found_by_its_mark_and_another_sessions_service_is_not() -> None:
    """A service whose parent exited (reparented to init) still carries the mark; one started by another checkout's
    session (another mark, not our descendant) is left alone."""
    shell = "{ exec \"$@\"; } </dev/null >/dev/null 2>&1 & echo $!"
    orphan = int(subprocess.run(["sh", "-c", shell, "sh", *SLEEPER], capture_output=True, check=True).stdout)
    foreign = int(subprocess.run(["sh", "-c", shell, "sh", *SLEEPER], capture_output=True, check=True,
                                 env={**os.environ, SESSION_ENV: "another-session"}).stdout)
    try:
        found = _until_found(orphan, ancestor=-1)  # by the mark alone: the shell is gone
        assert orphan in found and foreign not in found
    finally:
        for pid in (orphan, foreign):
            os.kill(pid, 9)
