"""What the build's driver does to Ray besides using it: start a local cluster that leaves nothing behind, and
keep Ray's native error lines off a quiet terminal.

    start_local(**chatter)    ray.init without the dashboard (a build has no use for it), then `reaper.py` for
                              the session: no process of it survives the driver, however the driver dies
    started_local()           whether the connected Ray is one `start_local` started (the CLI then just exits)
    native_stderr_to_logs()   the driver's file descriptor 2 (where Ray's C++ core worker writes its error lines,
                              which it also writes to its own log file) -> a file in Ray's log folder; Python's
                              stderr (the build's one-line errors, warnings) stays on the terminal (`sift-build -q`)

Everything else a local Ray starts is either what a build uses (GCS, raylet, workers, the runtime-env agent that
starts workers) or cannot be turned off through `ray.init` (the dashboard agent, the autoscaler monitor, the log
monitor); the reaper ends those too.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REAPER = Path(__file__).with_name("reaper.py")
_REAPED: list[str] = []   # Ray's name (`get_session_name`) for the local instance this process started


def start_local(**chatter) -> None:
    """Start a local Ray for this driver, and the process that cleans up after it (`reaper.py`)."""
    import ray

    ray.init(include_dashboard=False, **chatter)
    session = ray.get_runtime_context().get_session_name()
    # Its own process group: a Ctrl-C at the terminal stops the driver, which shuts Ray down, then the reaper.
    subprocess.Popen([sys.executable, str(REAPER), str(os.getpid()), session], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)
    _REAPED[:] = [session]


def started_local() -> bool:
    """Whether the Ray this process is connected to is a local one it started, with its reaper, and still up:
    then nothing of it outlives the process, however the process ends."""
    import ray

    return bool(_REAPED) and ray.is_initialized() and ray.get_runtime_context().get_session_name() in _REAPED


def native_stderr_to_logs() -> Path:
    """Send what native code writes to this process's stderr to `sift-build-<pid>.err` in Ray's log folder, and
    keep Python's `sys.stderr` (and the logging handlers writing to it) on the original stderr. Returns the file."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)  # Ray names its log folder nowhere public
    logs = Path(node.get_logs_dir_path()) if node is not None else Path(tempfile.gettempdir())
    target = logs / f"sift-build-{os.getpid()}.err"
    old = sys.stderr
    old.flush()
    new = os.fdopen(os.dup(2), "w", buffering=1, encoding=old.encoding, errors=old.errors)
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for handler in {h for lg in loggers for h in lg.handlers}:
        # (logging's last-resort handler has no stream of its own: it writes to sys.stderr, the new one)
        if type(handler) is logging.StreamHandler and handler.stream in (old, sys.__stderr__):
            handler.setStream(new)
    sys.stderr = new
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    return target
