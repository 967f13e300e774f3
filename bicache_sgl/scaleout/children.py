"""The processes the data-parallel launcher supervises (workers and the router), each in its own
session with the parent-death signal set, its output copied to our stderr with a prefix."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

# the single server's readiness line (bicache_sgl.server.app.READY_MESSAGE; not imported: that
# module loads FastAPI and the engine package, which this process never needs)
READY_MESSAGE = "The server is fired up and ready to roll!"
WORKER_HOST = "127.0.0.1"

# Run a module with the parent-death signal set (Linux): if the launcher dies, even by SIGKILL,
# the child gets SIGTERM. The signal survives exec; argv: <launcher pid> <module> <args...>.
_EXEC_WITH_PDEATHSIG = (
    "import os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"  # PR_SET_PDEATHSIG
    "    if os.getppid() != int(sys.argv[1]):\n"
    "        sys.exit(0)\n"  # the launcher died before the prctl
    "os.execv(sys.executable, [sys.executable, '-m'] + sys.argv[2:])\n"
)


@dataclass
class Child:
    """A supervised process (a worker or the router) with its output copied to our stderr."""

    name: str
    proc: subprocess.Popen | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    reader: threading.Thread | None = None

    def start(self, module: str, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), module, *args]
        self.tail.clear()
        # own session: a terminal's Ctrl-C reaches only the launcher, which stops the children in order
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        self.reader = threading.Thread(target=self._copy_output, args=(self.proc,), daemon=True,
                                       name=f"output-{self.name}")
        self.reader.start()

    def _copy_output(self, proc: subprocess.Popen) -> None:
        prefix = f"[{self.name}] "
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            # the launcher's ready line is the only one a harness may wait for: a worker's is reworded
            line = line.replace(READY_MESSAGE, "worker ready:")
            self.tail.append(line)
            try:
                sys.stderr.write(prefix + line + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr is gone; keep draining the pipe
                pass

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """``sig`` to the child's process group (the child and anything it started in its group)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def log_tail(self, n: int = 15) -> str:
        return "\n".join(list(self.tail)[-n:])


@dataclass
class Worker(Child):
    index: int = 0
    port: int = 0
    state: str = "starting"  # starting -> ready; dead when it failed and is not restarted
    restarts: int = 0
    started_at: float = 0.0
    bad_health: int = 0
    next_probe: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{WORKER_HOST}:{self.port}"
