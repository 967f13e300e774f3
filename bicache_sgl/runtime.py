"""``bicache_sgl.Runtime``: the server in a child process, for SGLang frontend programs, and the
one launcher of server processes (the tests and every benchmark script start servers with it).

Like ``sgl.Runtime``::

    import sglang as sgl
    from bicache_sgl import Runtime

    with Runtime(model_path="path/to/model", block_length=32) as rt:
        sgl.set_default_backend(rt.endpoint)
        ...

Keyword arguments are server flags (``block_length=8`` -> ``--block-length 8``; ``True`` for a
switch, ``False``/``None`` to leave it out). The child listens on a free loopback port; the
constructor returns once ``/health_generate`` answers 200. ``parse_server_args`` turns a
command-line string of server flags into those keyword arguments.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_flags(kwargs: dict[str, Any]) -> list[str]:
    """``{"block_length": 8, "disable_radix_cache": True}`` -> ``["--block-length", "8", "--disable-radix-cache"]``."""
    out: list[str] = []
    for key, value in kwargs.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out.append(flag)
            out.extend(str(v) for v in value)
        else:
            out.extend([flag, str(value)])
    return out


def parse_server_args(text: str | None) -> dict[str, Any]:
    """The inverse of :func:`server_flags`: ``"--block-length 8 --disable-radix-cache"`` ->
    ``{"block_length": "8", "disable_radix_cache": True}`` (``--flag=value`` works too; a flag with
    several values gives a list)."""
    out: dict[str, Any] = {}
    key = None
    for tok in shlex.split(text or ""):
        if tok.startswith("--"):
            name, eq, value = tok[2:].partition("=")
            key = name.replace("-", "_")
            if not key:
                raise ValueError(f"bad server flag {tok!r}")
            out[key] = value if eq else True
            if eq:
                key = None
        elif key is None:
            raise ValueError(f"server argument {tok!r} does not follow a --flag")
        elif out[key] is True:
            out[key] = tok
        elif isinstance(out[key], list):
            out[key].append(tok)
        else:
            out[key] = [out[key], tok]
    return out


def http_json(url: str, payload: Any = None, *, method: str | None = None, api_key: str | None = None,
              timeout: float | None = None) -> Any:
    """GET (or POST with a JSON ``payload``) ``url``; the parsed JSON answer, else its text.
    Raises ``urllib.error.URLError`` / ``HTTPError`` (an ``OSError``) when the server does not answer 2xx."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


class Runtime:
    """Start ``python -m bicache_sgl.launch_server`` on a free port and wait until it serves.

    Attributes: ``url`` (``http://127.0.0.1:PORT``), ``port``, ``endpoint`` (an
    ``sglang.RuntimeEndpoint``, created on first use), ``log_path`` (the child's output),
    ``api_key``, ``admin_api_key`` (sent on the admin routes: ``flush_cache``). ``shutdown()``
    (also on exit and ``with``) stops the child.
    """

    def __init__(self, model_path: str | None = None, *, host: str = "127.0.0.1", port: int | None = None,
                 timeout: float = 300.0, log_path: str | None = None, log_level: str = "info",
                 env: dict[str, str] | None = None, **server_args: Any) -> None:
        self.host = host
        self.port = port or find_free_port(host)
        self.api_key = server_args.get("api_key")
        self.admin_api_key = server_args.get("admin_api_key")
        h = f"[{host}]" if ":" in host else host
        self.url = f"http://{h}:{self.port}"
        self.generate_url = self.url + "/generate"
        self._endpoint = None
        args = {"model_path": model_path, "host": host, "port": self.port, "log_level": log_level, **server_args}
        self.cmd = [sys.executable, "-m", "bicache_sgl.launch_server", *server_flags(args)]
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="bicache-sgl-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        child_env = dict(os.environ)
        child_env.update(env or {})
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc: subprocess.Popen | None = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env,
                start_new_session=True)
        atexit.register(self.shutdown)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"the server exited (code {code}) before it was ready:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server did not become healthy within {timeout:.0f} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    @property
    def endpoint(self):
        """An ``sglang.RuntimeEndpoint`` for ``sgl.set_default_backend`` (needs the sglang package)."""
        if self._endpoint is None:
            try:
                from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
            except ImportError as e:
                raise ImportError("Runtime.endpoint needs the sglang frontend package: "
                                  "pip install 'sglang==0.5.2' pybase64") from e
            self._endpoint = RuntimeEndpoint(self.url, api_key=self.api_key)
        return self._endpoint

    # ------------------------------------------------------------------------------------------
    def request(self, path: str, payload: Any = None, method: str | None = None,
                timeout: float | None = None) -> Any:
        """``path`` on this server (with the API key), parsed as by :func:`http_json`."""
        return http_json(self.url + path, payload, method=method, api_key=self.api_key, timeout=timeout)

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | None = None,
                 timeout: float | None = None, **kwargs: Any) -> Any:
        """POST /generate and return the parsed JSON (a dict, or a list for a list of prompts).
        Other fields (``input_ids=...``, ``stream``...) go into the request as they are."""
        payload = {"sampling_params": sampling_params or {}, **kwargs}
        if prompt is not None:
            payload["text"] = prompt
        return self.request("/generate", payload, timeout=timeout)

    def get_server_info(self) -> dict:
        return self.request("/get_server_info", timeout=60)

    def internal_state(self) -> dict:
        """The scheduler's counters and cache statistics (``internal_states[0]`` of /get_server_info)."""
        return (self.get_server_info().get("internal_states") or [{}])[0]

    def get_model_info(self) -> dict:
        return self.request("/get_model_info", timeout=60)

    def flush_cache(self, timeout: float | None = None) -> Any:
        """POST /flush_cache; with ``timeout`` the server retries that long while requests run. An
        admin route: it takes the admin key when the server has one (docs/server.md)."""
        return http_json(self.url + "/flush_cache" + ("" if timeout is None else f"?timeout={timeout:g}"),
                         method="POST", api_key=self.admin_api_key or self.api_key,
                         timeout=None if timeout is None else timeout + 30)

    def cache_prefix(self, prefix: str) -> None:
        self.generate(prefix, {"max_new_tokens": 0})

    def shutdown(self, timeout: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
                proc.wait(5)
        atexit.unregister(self.shutdown)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: modules may be gone
            self.shutdown(timeout=5.0)
