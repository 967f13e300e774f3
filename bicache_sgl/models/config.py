"""Architecture-neutral model configuration parsed from a checkpoint's config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


class CheckpointError(ValueError):
    """A checkpoint folder cannot be used; the message names the problem."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llada" | "dream"
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # rows of the embedding / LM head
    rope_theta: float
    rms_norm_eps: float
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    logit_shift: int  # 1 for Dream: position i-1's output predicts token i
    torch_dtype: str | None = None
    name: str = ""

    def __post_init__(self) -> None:
        for k in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise CheckpointError(f"config.json: {k} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(f"config.json: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"config.json: head dim {self.head_dim} must be even for RoPE")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(f"config.json: mask_token_id {self.mask_token_id} is outside the vocabulary ({self.vocab_size})")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise CheckpointError(f"config.json: rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise CheckpointError(f"config.json: rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


LLADA_ARCHS = ("LLaDAModelLM", "LLaDAModel")
DREAM_ARCHS = ("DreamModel", "DreamForMaskedLM")
MASK_ID_DEFAULTS = {"llada": 126336, "dream": 151666}


def _req(cfg: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    raise CheckpointError(f"config.json is missing {' / '.join(keys)}")


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    return (int(v),)


def detect_arch(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    model_type = str(cfg.get("model_type", "")).lower()
    if any(a in LLADA_ARCHS for a in archs) or model_type == "llada":
        return "llada"
    if any(a in DREAM_ARCHS for a in archs) or model_type == "dream":
        return "dream"
    raise CheckpointError(
        f"unsupported architecture {archs or model_type!r}: bicache-sgl runs LLaDA "
        f"(architectures {list(LLADA_ARCHS)}, model_type 'llada') and Dream ({list(DREAM_ARCHS)}, model_type 'Dream')")


def parse_model_config(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    """config.json dict -> ModelConfig. Raises CheckpointError naming the bad key."""
    arch = detect_arch(cfg)
    try:
        if arch == "llada":
            d = int(_req(cfg, "d_model"))
            n_heads = int(_req(cfg, "n_heads"))
            n_kv = int(cfg.get("n_kv_heads") or n_heads)
            if cfg.get("multi_query_attention"):
                n_kv = 1
            vocab = int(cfg.get("embedding_size") or _req(cfg, "vocab_size"))
            mlp = cfg.get("mlp_hidden_size") or int(cfg.get("mlp_ratio", 4) * d)
            if cfg.get("block_type", "llama") not in ("llama", "sequential"):
                raise CheckpointError(f"config.json: block_type {cfg.get('block_type')!r} is not supported (llama only)")
            if cfg.get("alibi"):
                raise CheckpointError("config.json: alibi position encoding is not supported (rope only)")
            include_bias = bool(cfg.get("include_bias", False))
            eos = _ids(cfg.get("eos_token_id", 126081))
            return ModelConfig(
                arch=arch, n_layers=int(_req(cfg, "n_layers")), hidden_size=d, n_heads=n_heads, n_kv_heads=n_kv,
                head_dim=d // n_heads, intermediate_size=int(mlp), vocab_size=vocab,
                rope_theta=float(cfg.get("rope_theta", 10000.0)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                mask_token_id=int(cfg.get("mask_token_id", MASK_ID_DEFAULTS["llada"])), eos_token_ids=eos,
                pad_token_id=cfg.get("pad_token_id"), tie_word_embeddings=bool(cfg.get("weight_tying", False)),
                qkv_bias=include_bias or bool(cfg.get("include_qkv_bias", False)), o_bias=include_bias,
                mlp_bias=include_bias, max_position_embeddings=int(cfg.get("max_sequence_length", 4096)),
                logit_shift=0, torch_dtype=cfg.get("torch_dtype"), name=name)
        d = int(_req(cfg, "hidden_size"))
        n_heads = int(_req(cfg, "num_attention_heads"))
        return ModelConfig(
            arch=arch, n_layers=int(_req(cfg, "num_hidden_layers")), hidden_size=d, n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads), head_dim=int(cfg.get("head_dim") or d // n_heads),
            intermediate_size=int(_req(cfg, "intermediate_size")), vocab_size=int(_req(cfg, "vocab_size")),
            rope_theta=float(cfg.get("rope_theta", 10000.0)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            mask_token_id=int(cfg.get("mask_token_id", MASK_ID_DEFAULTS["dream"])),
            eos_token_ids=_ids(cfg.get("eos_token_id", 151643)), pad_token_id=cfg.get("pad_token_id"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=True, o_bias=False,
            mlp_bias=False, max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            logit_shift=1, torch_dtype=cfg.get("torch_dtype"), name=name)
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"config.json has a bad value: {e}") from e
