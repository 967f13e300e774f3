"""The first-run profile's cache on disk: where it lives and what identifies a checkpoint.

A cached profile is keyed by the checkpoint's fingerprint and the calibration's settings
(``auto.AutoCalibration.settings``, which holds ``auto.VERSION``); see docs/calibration.md
("The cache").
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ..bicache.profile import PROFILE_FILENAME

CACHE_ENV = "BICACHE_SGL_CACHE"  # cache root; default ~/.cache/bicache_sgl
CONTENT_HASH_MAX_BYTES = 32 << 20  # checkpoint files up to this size are hashed by content
_HEX_BLOB = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")


def cache_dir() -> Path:
    """``$BICACHE_SGL_CACHE`` or ``~/.cache/bicache_sgl``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "bicache_sgl"


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_fingerprint(model_path: str | Path) -> dict[str, str]:
    """File name -> identity, for every regular file of the checkpoint folder but the profile:
    the content digest of files up to ``CONTENT_HASH_MAX_BYTES`` (config, tokenizer, small
    weights), the Hugging Face blob digest of a hub snapshot's files (their link target is named
    by it), and size + mtime (ns) of other large files. Hashing gigabytes of weights would make
    every start pay what the cache saves; size + mtime changes whenever the weights are written
    again (a new fine-tune, a new download), a copy that drops the mtime only costs one more
    calibration, and a false hit would need other weights of the same sizes with the same
    nanosecond mtimes."""
    out: dict[str, str] = {}
    for f in sorted(Path(model_path).iterdir()):
        if f.name.startswith(".") or f.name == PROFILE_FILENAME or not f.is_file():
            continue
        real = f.resolve()
        st = real.stat()
        if f.is_symlink() and _HEX_BLOB.match(real.name):
            out[f.name] = "blob:" + real.name
        elif st.st_size <= CONTENT_HASH_MAX_BYTES:
            out[f.name] = "sha256:" + sha256_file(real)
        else:
            out[f.name] = f"size:{st.st_size},mtime_ns:{st.st_mtime_ns}"
    return out
