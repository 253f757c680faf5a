"""Leave no process of a local Ray session behind once the driver that started it is gone (`ray_driver.py`).

    python reaper.py DRIVER_PID SESSION_NAME

Ray ties the processes it starts itself (GCS, raylet, monitors) to the driver with PR_SET_PDEATHSIG, but the
raylet starts the dashboard agent and the runtime-env agent, and when the driver is SIGKILLed (and with it the
raylet) those agents try to report the raylet's death to the GCS, which is gone too, and never exit, nor
answer SIGTERM. This process, started by the driver right after `ray.init`, remembers every descendant of the
driver that belongs to the session (it holds a file of the session's folder, or descends from one that does),
polling while the driver lives; once the driver is gone (this process's parent changes), it SIGKILLs the
remembered processes still alive (same pid and start time), until none is left or GIVE_UP_SECONDS pass.

Standard library only, run as a script: it starts in a fraction of a second and imports nothing of the build.
"""
from __future__ import annotations

import os
import signal
import sys
import time

POLL_SECONDS = 0.2       # how often the driver is checked
SCAN_SECONDS = 1.0       # how often the session's processes are listed while the driver lives
GIVE_UP_SECONDS = 30.0   # how long leftovers are killed after the driver is gone


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, start time in clock ticks, state) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # the command name in parentheses may hold spaces
        table[int(entry)] = (int(fields[1]), fields[19], fields[0])
    return table


def _holds_session_file(pid: int, mark: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if mark in os.readlink(f"/proc/{pid}/fd/{fd}"):
                return True
        except OSError:
            continue
    return False


def remember(driver: int, mark: str, known: dict[int, str]) -> None:
    """Add the driver's descendants that belong to the session to `known` (pid -> start time)."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    queue = list(children.get(driver, []))
    while queue:  # parents before children, so a child of a session process is one too
        pid = queue.pop(0)
        ppid, start, _ = table[pid]
        if pid != os.getpid() and (pid in known or ppid in known or _holds_session_file(pid, mark)):
            known[pid] = start
        queue += children.get(pid, [])


def reap(known: dict[int, str]) -> None:
    """SIGKILL every remembered process still alive, until none is left or GIVE_UP_SECONDS pass."""
    deadline = time.monotonic() + GIVE_UP_SECONDS
    while time.monotonic() < deadline:
        table = _processes()
        alive = [pid for pid, start in known.items()
                 if pid in table and table[pid][1] == start and table[pid][2] != "Z"]
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(POLL_SECONDS)


def main(driver: int, session: str) -> None:
    mark, known, scanned = f"/{session}/", {}, 0.0
    while os.getppid() == driver:
        if time.monotonic() - scanned >= SCAN_SECONDS:
            remember(driver, mark, known)
            scanned = time.monotonic()
        time.sleep(POLL_SECONDS)
    reap(known)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
