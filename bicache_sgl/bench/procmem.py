"""Memory of a server process, as the benchmarks and the reliability tests observe it: resident set
size (psutil when installed, else ``/proc``), the kernel's lifetime peak, and a sampling thread."""

from __future__ import annotations

import threading


def proc_status_bytes(pid: int, field: str) -> int | None:
    """A ``kB`` line of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``...) in bytes; None when unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes(pid: int, children: bool = False) -> int:
    """Resident set size of a process, or with ``children`` of its whole tree (psutil when installed;
    without it ``/proc``, the process alone). Raises ``RuntimeError`` when it cannot be read."""
    try:
        import psutil  # type: ignore[import-not-found]
    except ImportError:
        psutil = None
    if psutil is not None:
        proc = psutil.Process(pid)
        procs = [proc] + (proc.children(recursive=True) if children else [])
        return sum(p.memory_info().rss for p in procs if p.is_running())
    rss = proc_status_bytes(pid, "VmRSS")
    if rss is None:
        raise RuntimeError(f"no VmRSS for pid {pid}")
    return rss


class RSSSampler:
    """Peak resident set size of a process tree, sampled every ``interval`` seconds in a thread."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def rss(self) -> int:
        try:
            return rss_bytes(self.pid, children=True)
        except Exception:
            return 0

    def reset(self) -> None:
        self.peak = self.rss()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(self.interval)

    def start(self) -> RSSSampler:
        self.reset()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
