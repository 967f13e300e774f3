"""The decoding algorithm of a served block-diffusion checkpoint, as SGLang's server flags name it:
``--dllm-algorithm`` (``LowConfidence`` / ``JointThreshold``) and ``--dllm-algorithm-config FILE``.

Which family runs which algorithm is the family's declaration (``models/families``:
``FamilyDecoding.algorithms``; LLaDA2.x both, SDAR low_confidence only). This module turns the
two flags into the layers of the model's decode defaults (``load_block_model``), lowest first:

1. the family's published defaults (``models/block_config.FAMILY_DEFAULTS``);
2. the chosen algorithm's own defaults: SGLang's JointThreshold ones (threshold 0.5,
   edit_threshold 0.0, max_post_edit_steps 16); LowConfidence has none beyond the family's;
3. the checkpoint's generation_config.json;
4. the flags: the config file's keys, and with ``--dllm-algorithm LowConfidence`` (or a config
   file without ``--dllm-algorithm``: SGLang's default algorithm) editing off whatever
   generation_config.json says.

Without either flag the checkpoint decides: editing is on when its generation_config.json sets an
edit threshold (LLaDA2.1), else LowConfidence. docs/block_diffusion.md, section 5.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import SGLANG_ALGORITHM_NAMES
from ..decoding.plan import FamilyDecoding
from ..models.block_config import BlockDecodeDefaults

# SGLang's dLLM algorithm config keys per algorithm; ``block_size`` is its DllmConfig's (the block
# length), accepted by every algorithm and required to be the model's
ALGORITHM_KEYS: Mapping[str, tuple[str, ...]] = {
    "low_confidence": ("threshold", "block_size"),
    "joint_threshold": ("threshold", "edit_threshold", "max_post_edit_steps", "penalty_lambda", "block_size"),
}
# SGLang's JointThreshold defaults (its edit_threshold 0.0 allows every edit; None would be off)
JOINT_THRESHOLD_DEFAULTS: Mapping[str, Any] = {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16}


@dataclass(frozen=True)
class BlockAlgorithm:
    """The server's choice: ``algorithm`` (None: the checkpoint's generation_config.json decides),
    the decode defaults below generation_config.json (``defaults``) and above it
    (``overrides``), the config file's ``block_size`` (checked against the model's block length
    once loaded) and where it came from (``source``, for /get_server_info)."""

    algorithm: str | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    overrides: Mapping[str, Any] = field(default_factory=dict)
    block_size: int | None = None
    source: str = "checkpoint"

    def check_model(self, decode: BlockDecodeDefaults, family: FamilyDecoding, flag_threshold: float | None,
                    flag_steps: int | None) -> None:
        """After loading: the config file's block_size is the model's block length, the
        algorithm the decode defaults run is one the family accepts (generation_config.json may
        turn editing on), the config file's threshold does not contradict ``--threshold``, and
        ``--steps-per-block`` is not given to token editing (it has no step schedule)."""
        if self.block_size is not None and self.block_size != decode.block_length:
            raise ValueError(f"--dllm-algorithm-config: block_size {self.block_size} is not the block length "
                             f"{decode.block_length} {family.family} decodes in (the checkpoint's, or "
                             "--block-length; the exact block cache is keyed by it)")
        if decode.algorithm not in family.algorithms:
            raise ValueError(f"the checkpoint's generation_config.json sets an edit threshold (LLaDA2.1's token "
                             f"editing, joint_threshold), which the {family.family} family does not run; start with "
                             "--dllm-algorithm LowConfidence")
        thr = self.overrides.get("threshold")
        if thr is not None and flag_threshold is not None and thr != flag_threshold:
            raise ValueError(f"--threshold {flag_threshold} and --dllm-algorithm-config's threshold {thr} disagree; "
                             "give one")
        if flag_steps is not None and decode.edit_threshold is not None:
            raise ValueError("--steps-per-block does not apply to joint_threshold (LLaDA2.1's token editing): it has "
                             "no step schedule (a block takes at most block_length + max_post_edit_steps steps)")

    def describe(self, decode: BlockDecodeDefaults) -> dict[str, Any]:
        """The algorithm and its parameters as the model decodes them (for /get_server_info)."""
        out: dict[str, Any] = {"algorithm": decode.algorithm, "sglang_name": SGLANG_ALGORITHM_NAMES[decode.algorithm],
                               "source": self.source, "block_length": decode.block_length,
                               "threshold": decode.threshold}
        if decode.edit_threshold is None:
            out["steps_per_block"] = decode.steps
        else:
            out.update(edit_threshold=decode.edit_threshold, max_post_edit_steps=decode.max_post_edit_steps)
        return out


def choose_algorithm(family: FamilyDecoding, algorithm: str | None, config_path: str | None) -> BlockAlgorithm:
    """``--dllm-algorithm`` (canonical name or None) and ``--dllm-algorithm-config`` (a path or
    None) -> the layers of the decode defaults (module docstring). ValueError naming the flag,
    the file and the key at fault."""
    family.check_flags(algorithm, config_path)
    if algorithm is None and config_path is None:
        return BlockAlgorithm()
    alg = algorithm or family.default_algorithm  # a config file alone: SGLang's default algorithm
    values = read_algorithm_config(config_path, alg) if config_path is not None else {}
    block_size = values.pop("block_size", None)
    defaults = dict(JOINT_THRESHOLD_DEFAULTS) if alg == "joint_threshold" else {}
    overrides = dict(values)
    if alg == "low_confidence":
        overrides["edit_threshold"] = None  # the flag is above generation_config.json's editing keys
    src = "--dllm-algorithm" if algorithm is not None else "--dllm-algorithm-config"
    if algorithm is not None and config_path is not None:
        src += " + --dllm-algorithm-config"
    return BlockAlgorithm(alg, defaults, overrides, block_size, src)


def _load_file(path: str) -> Any:
    """A YAML (SGLang's format) or JSON file's content; JSON by the .json suffix."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--dllm-algorithm-config {path}: cannot read it: {e}") from None
    if path.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--dllm-algorithm-config {path}: not valid JSON: {e}") from None
    import yaml  # a dependency (pyproject.toml), as it is transformers'
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--dllm-algorithm-config {path}: not valid YAML: {e}") from None


def read_algorithm_config(path: str, algorithm: str) -> dict[str, Any]:
    """The file's parameters for ``algorithm`` (ALGORITHM_KEYS), checked: unknown keys are refused
    by name, ``penalty_lambda`` other than 0 is refused (not implemented), and each value is
    checked as the decode defaults check it. Returns the keys as ``BlockDecodeDefaults`` names them
    (``block_size`` kept as is); an empty file has none."""
    raw = _load_file(path)
    if raw is None:
        raw = {}
    where = f"--dllm-algorithm-config {path}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must hold a mapping of parameter names to values, got {type(raw).__name__}")
    keys = ALGORITHM_KEYS[algorithm]
    unknown = [k for k in raw if k not in keys]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(str, unknown))} for "
                         f"{SGLANG_ALGORITHM_NAMES[algorithm]}; it takes {', '.join(keys)}")
    out: dict[str, Any] = {}
    for k, v in raw.items():
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        whole = number and float(v).is_integer()
        if k in ("block_size", "max_post_edit_steps"):
            if not whole:
                raise ValueError(f"{where}: {k} must be an integer, got {v!r}")
            v = int(v)
        elif not number:
            raise ValueError(f"{where}: {k} must be a number, got {v!r}")
        if k == "penalty_lambda":
            if v != 0:
                raise ValueError(f"{where}: penalty_lambda {v} (JointThreshold's repetition penalty) is not "
                                 "implemented; only 0 (off)")
            continue
        out[k] = float(v) if k in ("threshold", "edit_threshold") else v
    knobs = {"block_length": 1, "steps": 1, "threshold": 0.5}
    knobs.update((k, v) for k, v in out.items() if k != "block_size")
    try:  # each knob's one check: the decode defaults' own
        BlockDecodeDefaults(**knobs)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return out
