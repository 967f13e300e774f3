"""Load a checkpoint of any registered family (``models/families/``): local folder or Hugging
Face hub id, single or sharded safetensors, tokenizer and chat template from the same folder
(else the family's fallback template), and the generation defaults of its
``generation_config.json`` (Dream ships its ``diffusion_generate`` settings there).

Every failure is a CheckpointError whose message names the file, key or tensor at fault.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import canonical_algorithm
from .config import CheckpointError, ModelConfig, parse_model_config
from .families import family_of
from .model import DiffusionLM
from .special_ids import parse_with_special_ids
from .weights import checkpoint_names

log = logging.getLogger(__name__)

DTYPE_MAP = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def default_model_path() -> str:
    """The bundled default model shipped inside the package."""
    return str(Path(__file__).resolve().parent.parent / "assets" / "default_model")


def resolve_model_path(model_path: str | None) -> str:
    """A local folder as-is; ``org/name`` fetched from the hub (config, safetensors, tokenizer)."""
    if model_path is None:
        path = default_model_path()
        if not (Path(path) / "config.json").exists():
            raise CheckpointError(f"the bundled default model is missing at {path}; pass --model-path")
        return path
    p = Path(os.path.expanduser(model_path))
    if p.is_dir():
        return str(p)
    if p.exists():
        raise CheckpointError(f"model path {model_path} is a file; expected a checkpoint folder with config.json")
    if model_path.count("/") != 1 or model_path.startswith((".", "/")):
        raise CheckpointError(f"model path {model_path!r} is neither a local folder nor a Hugging Face hub id "
                              "(org/name)")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja",
                                                             "*.py", "tokenizer*"])
    except Exception as e:  # network errors come in many types; the message is what matters
        raise CheckpointError(f"could not fetch {model_path!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
                              "Is the hub reachable? Download the checkpoint elsewhere and pass its local "
                              "folder.") from e


def _read_json_object(f: Path) -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object; anything else is a CheckpointError."""
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON: {e}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {f}: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{f} must hold a JSON object")
    return data


def read_config(path: str) -> dict[str, Any]:
    f = Path(path) / "config.json"
    if not f.exists():
        raise CheckpointError(f"{path} has no config.json")
    return _read_json_object(f)


@dataclass(frozen=True)
class GenerationDefaults:
    """Request defaults a checkpoint ships in ``generation_config.json`` (Dream's
    ``diffusion_generate`` keys). ``None``: not set there (or ``null``). Precedence, highest
    first: the request's sampling_params, the server's flags, these, the built-in defaults."""

    steps: int | None = None  # total denoising steps of the generation region
    algorithm: str | None = None  # "alg"
    eps: float | None = None
    alg_temp: float | None = None
    temperature: float | None = None
    top_p: float | None = None

    def sampling_defaults(self) -> dict[str, float]:
        """The SamplingParams defaults these give (for :meth:`SamplingParams.resolved`)."""
        return {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None}


@dataclass(frozen=True)
class CheckpointConfig(ModelConfig):
    """A ModelConfig read from a checkpoint folder, with its generation defaults."""

    generation: GenerationDefaults = GenerationDefaults()


def generation_defaults(cfg: ModelConfig) -> GenerationDefaults:
    """The generation defaults of a config (none for a ModelConfig not read from a folder)."""
    g = getattr(cfg, "generation", None)
    return g if isinstance(g, GenerationDefaults) else GenerationDefaults()


def _gen_value(key: str, v: Any) -> Any:
    """A generation_config.json value, checked; raises ValueError saying what is wrong."""
    def number(x: Any) -> float:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"must be a number, got {x!r}")
        return float(x)
    if key == "steps":
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"must be an integer >= 1, got {v!r}")
        return v
    if key == "alg":
        return canonical_algorithm(v, "alg")
    x = number(v)
    if key == "eps" and not 0 < x < 1:
        raise ValueError(f"must be in (0, 1), got {v!r}")
    if key in ("alg_temp", "temperature") and x < 0:
        raise ValueError(f"must be >= 0, got {v!r}")
    if key == "top_p" and not 0 < x <= 1:
        raise ValueError(f"must be in (0, 1], got {v!r}")
    return x


_GEN_FIELDS = (("steps", "steps"), ("alg", "algorithm"), ("eps", "eps"), ("alg_temp", "alg_temp"),
               ("temperature", "temperature"), ("top_p", "top_p"))


def read_generation_config(path: str) -> GenerationDefaults:
    """The generation defaults of ``generation_config.json`` in ``path`` (none without the file).
    A file that is not a JSON object is a CheckpointError; a key with a value this server cannot
    use (an algorithm it does not implement, a negative temperature) is left out with a warning."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return GenerationDefaults()
    data = _read_json_object(f)
    kw: dict[str, Any] = {}
    for key, name in _GEN_FIELDS:
        v = data.get(key)
        if v is None:
            continue
        try:
            kw[name] = _gen_value(key, v)
        except ValueError as e:
            log.warning("%s: ignoring %s (%s); the server's default is used instead", f, key, e)
    g = GenerationDefaults(**kw)
    if kw:
        log.info("request defaults from %s: %s", f, ", ".join(f"{k}={v}" for k, v in kw.items()))
    return g


def load_model_config(path: str) -> CheckpointConfig:
    """config.json, with the generation defaults of generation_config.json when present and the
    special ids read as the published code reads them (models/special_ids.py)."""
    raw = read_config(path)
    fam = family_of(raw)
    # the special ids as the published code reads them (config.json, generation_config.json, the
    # tokenizer's named tokens, the family's default last): models/special_ids.py
    cfg = parse_with_special_ids(path, raw, lambda c: parse_model_config(c, name=Path(path).name), fam.name,
                                 fam.mask_token_id, fam.eos_token_ids)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return CheckpointConfig(**fields, generation=read_generation_config(path))


def _weight_files(path: str) -> dict[str, str]:
    """checkpoint tensor name -> file, from the index (sharded) or the single file."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.exists():
        return _read_index(p, index)
    single = p / "model.safetensors"
    files = [single] if single.exists() else sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no safetensors weights (model.safetensors or an index file)")
    from safetensors import safe_open
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():  # noqa: SIM118 (safe_open is not iterable)
                    out[k] = str(f)
        except Exception as e:
            raise CheckpointError(f"cannot read {f}: not a valid safetensors file ({e})") from e
    return out


def _read_index(folder: Path, index: Path) -> dict[str, str]:
    """A sharded checkpoint's index: {"weight_map": {tensor name: shard file in this folder}}."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict):
        raise CheckpointError(f"{index} is not a valid safetensors index: it needs a \"weight_map\" object "
                              "(tensor name -> shard file)")
    shards: dict[str, Path] = {}
    for name, f in wm.items():
        if not isinstance(f, str) or not f:
            raise CheckpointError(f"{index}: weight_map[{name!r}] must be a shard file name, got {f!r}")
        if f not in shards:
            # judged by the name, not by resolving: hub snapshots link their shards to blobs elsewhere
            if os.path.isabs(f) or os.path.normpath(f).split(os.sep)[0] in ("..", "."):
                raise CheckpointError(f"{index}: shard {f!r} is outside the checkpoint folder")
            shards[f] = folder / f
    missing = sorted(f for f, t in shards.items() if not t.is_file())
    if missing:
        raise CheckpointError(f"{index} names shard(s) that do not exist (or are not files): {', '.join(missing)}")
    return {k: str(folder / f) for k, f in wm.items()}


def load_state_dict(path: str, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    where = _weight_files(path)
    expected = checkpoint_names(cfg)
    missing = [ck for ck, _ in expected.values() if ck not in where]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {path} is missing tensor(s): {', '.join(missing[:5])}{more}")
    by_file: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
    for ours, (ck, shape) in expected.items():
        by_file.setdefault(where[ck], []).append((ours, ck, shape))
    sd = {}
    for f, items in by_file.items():
        try:
            with safe_open(f, framework="pt") as sf:
                present = set(sf.keys())
                for ours, ck, shape in items:
                    if ck not in present:
                        raise CheckpointError(f"the index maps tensor {ck} to {Path(f).name}, "
                                              "which does not contain it")
                    t = sf.get_tensor(ck)
                    if tuple(t.shape) != shape:
                        raise CheckpointError(f"tensor {ck} in {Path(f).name} has shape {tuple(t.shape)}, "
                                              f"expected {shape} from config.json")
                    if t.dtype not in _FLOAT_DTYPES:
                        dt = str(t.dtype).replace("torch.", "")
                        raise CheckpointError(f"tensor {ck} in {Path(f).name} has dtype {dt}; "
                                              "expected a float dtype (float32, bfloat16, float16)")
                    sd[ours] = t.to(dtype)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read weights from {f} (truncated or corrupt safetensors?): {e}") from e
    extra = sorted(set(where) - {ck for ck, _ in expected.values()})
    extra = [k for k in extra if "rotary" not in k and "inv_freq" not in k]
    if extra:
        log.warning("ignoring %d unexpected tensor(s) in %s, e.g. %s", len(extra), path, extra[0])
    return sd


def pick_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPE_MAP[name]
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls are slow and lossy on most CPUs
    return DTYPE_MAP.get(str(cfg.torch_dtype), torch.bfloat16) if cfg.torch_dtype != "float32" else torch.float32


def load_model(path: str, dtype: str = "auto", device: str | torch.device = "cpu") -> tuple[DiffusionLM, ModelConfig]:
    """Build the model for a resolved checkpoint folder and load its weights (validated)."""
    cfg = load_model_config(path)
    if cfg.attention != "bidirectional":
        raise CheckpointError(f"{path} is a {cfg.arch} checkpoint ({cfg.attention} attention): it is served by the "
                              "block-diffusion engine (bicache_sgl.blockdiff, which launch_server picks), not here")
    dev = torch.device(device)
    tdtype = pick_dtype(dtype, cfg, dev)
    sd = load_state_dict(path, cfg, tdtype)
    with torch.device("meta"):
        model = DiffusionLM(cfg)
    model = model.to_empty(device=dev).to(tdtype)
    model.load_state_dict(sd, strict=True, assign=False)
    model.eval()
    model.requires_grad_(False)
    model.fuse()
    return model, cfg


def remote_tokenizer_class(path: str | Path) -> str | None:
    """The tokenizer class named by the folder's tokenizer_config.json when only the
    checkpoint's own code defines it (``auto_map``, or a ``tokenizer_class`` transformers does
    not have, e.g. Dream's ``DreamTokenizer``); None otherwise."""
    f = Path(path) / "tokenizer_config.json"
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent or unreadable: AutoTokenizer reports it
    if not isinstance(cfg, dict):
        return None
    cls = cfg.get("tokenizer_class")
    cls = cls if isinstance(cls, str) and cls else None
    auto = cfg.get("auto_map")
    entry = auto.get("AutoTokenizer") if isinstance(auto, dict) else auto if isinstance(auto, list) else None
    names = [n for n in (entry if isinstance(entry, list) else [entry]) if isinstance(n, str) and n]
    if names:
        return cls or names[0].rsplit(".", 1)[-1]
    if cls is not None:
        import transformers
        if not (hasattr(transformers, cls) or hasattr(transformers, cls.removesuffix("Fast"))):
            return cls
    return None


def _load_fast_tokenizer_file(path: str, cls: str):
    """A checkpoint whose tokenizer_config.json names a class defined by its own code: the fast
    tokenizer file (tokenizer.json) with the config's special tokens and chat template, through
    transformers' own PreTrainedTokenizerFast (nothing from the folder is executed)."""
    from transformers import PreTrainedTokenizerFast
    p = Path(path)
    if not (p / "tokenizer.json").is_file():
        raise CheckpointError(
            f"the tokenizer in {path} is {cls}, a class defined by code shipped in the checkpoint "
            "(tokenizer_config.json: auto_map / tokenizer_class), which this server never runs, with or without "
            "--trust-remote-code; it loads such a tokenizer from a fast-tokenizer file, tokenizer.json, which "
            f"{path} does not have. Add one (Dream's DreamTokenizer is Qwen2's byte-level BPE tokenizer over "
            f"vocab.json and merges.txt under another name; for example: python -c \"from transformers import "
            f"Qwen2TokenizerFast as T; T.from_pretrained('{path}').save_pretrained('{path}')\"), or pass "
            "--tokenizer-path to a folder with the same vocabulary's tokenizer.json")
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    except Exception as e:
        raise CheckpointError(f"cannot load the tokenizer in {path}: its config names {cls} (checkpoint code, "
                              f"not run); {p / 'tokenizer.json'} could not be loaded in its place: {e}") from e
    log.info("%s: tokenizer_config.json names %s (checkpoint code, not run); loaded tokenizer.json with its "
             "special tokens and chat template instead", path, cls)
    return tok


def load_tokenizer(path: str, chat_template: str | None = None):
    """``AutoTokenizer`` from the folder (no remote code), falling back to its tokenizer.json.
    A tokenizer class defined by the checkpoint's own code (Dream's ``DreamTokenizer``) is
    replaced by the folder's tokenizer.json, loaded with the config's special tokens and chat
    template; without a tokenizer.json that is a CheckpointError saying how to make one."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    p = Path(path)
    if not ((p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists()
            or (p / "tokenizer.model").exists()):
        raise CheckpointError(f"no tokenizer found in {path} (expected tokenizer.json or tokenizer_config.json); "
                              "pass --tokenizer-path")
    from transformers.utils import logging as hf_logging
    remote = remote_tokenizer_class(p)
    try:
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # AutoTokenizer reads config.json and warns about model_type 'llada'
        try:
            if remote is not None:
                tok = _load_fast_tokenizer_file(path, remote)
            else:
                tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        finally:
            hf_logging.set_verbosity(verbosity)
    except CheckpointError:
        raise
    except Exception as e:
        if not (p / "tokenizer.json").exists():
            raise CheckpointError(f"cannot load the tokenizer in {path}: {e}") from e
        log.warning("AutoTokenizer failed for %s (%s); using tokenizer.json directly", path, e)
        try:
            tok = PreTrainedTokenizerFast(tokenizer_file=str(p / "tokenizer.json"))
        except Exception as e2:  # tokenizers raises plain Exception on a corrupt file
            raise CheckpointError(f"cannot load the tokenizer in {path}: AutoTokenizer failed ({e}); "
                                  f"{p / 'tokenizer.json'} is not a valid tokenizer file ({e2})") from e2
    if chat_template:
        # a file, or the template itself (os.path.isfile, unlike Path.exists, is False rather than
        # an error for a long Jinja string that is no valid path)
        tok.chat_template = Path(chat_template).read_text() if os.path.isfile(chat_template) else chat_template
    elif not getattr(tok, "chat_template", None) and (p / "chat_template.jinja").exists():
        tok.chat_template = (p / "chat_template.jinja").read_text()
    elif not getattr(tok, "chat_template", None):
        fallback = _family_chat_template(p)
        if fallback is not None:
            tok.chat_template = fallback
    return tok


def _family_chat_template(folder: Path) -> str | None:
    """The chat template the folder's model family declares for a tokenizer without one (None:
    no config.json, one no family claims, or a family without a fallback)."""
    try:
        return family_of(read_config(str(folder))).chat_template
    except CheckpointError:
        return None
