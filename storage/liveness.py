"""Which process is generating a running run, and whether it still runs.

A running run names its owner as "host:pid:start time". On the same host a restarted server sees at once that
the process which left a run running is gone (a pid alone could have been reused: the start time tells). Runs of
other hosts cannot be checked that way: their owners' heartbeats tell (Database.mark_interrupted).
"""

from __future__ import annotations

import socket

import psutil


def _identity(pid: int) -> str:
    return f"{socket.gethostname()}:{pid}:{psutil.Process(pid).create_time():.2f}"


def this_process() -> str:
    return _identity(psutil.Process().pid)


def is_gone(owner: str | None) -> bool:
    """True when `owner` was a process of this host that no longer runs; False when it runs or cannot be told."""
    host, _, rest = (owner or "").partition(":")
    pid, _, _ = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        return _identity(int(pid)) != owner or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return True
    except psutil.AccessDenied:          # it runs, as someone we may not inspect
        return False
