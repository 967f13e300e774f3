"""What the operating system says about processes, for the code that starts and watches them (the
engine's child process, the data-parallel launcher): a child's exit status in words, and the CPUs
this process may run on. Stdlib only, so any layer may use it."""

from __future__ import annotations

import os
import signal


def describe_exit(code: int | None, unknown: str = "still running") -> str:
    """A child process's ``returncode`` in words (``unknown`` when there is none yet)."""
    if code is None:
        return unknown
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
