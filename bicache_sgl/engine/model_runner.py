"""The model runner: owns the model, the attention backend and the device; turns one step's
sequences into batch metadata (``ForwardBatch``), runs ONE forward, and hands back each
sequence's logits. Nothing here knows about requests, the scheduler or the cache lifecycle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..attention import create_backend
from ..config import EngineConfig
from ..kv_cache.pool import KVPool
from ..kv_cache.store import SeqKV
from ..models.config import ModelConfig
from ..models.families import family_named
from ..models.forward_batch import ForwardBatch, SeqWork
from ..models.loader import load_model, load_tokenizer, resolve_model_path
from ..models.model import DiffusionLM

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


@dataclass(frozen=True)
class LoadedModel:
    model: DiffusionLM
    model_config: ModelConfig
    model_path: str
    tokenizer: object
    eos_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype


def load(cfg: EngineConfig) -> LoadedModel:
    """Model, config, tokenizer and the ids that end a generation."""
    device = pick_device(cfg.device)
    path = resolve_model_path(cfg.model_path)
    model, mc = load_model(path, cfg.dtype, device)
    tok = load_tokenizer(cfg.tokenizer_path or path, cfg.chat_template)
    eos = set(mc.eos_token_ids)
    vocab = tok.get_vocab()
    eos.update(int(vocab[t]) for t in family_named(mc.arch).end_of_turn if t in vocab)
    if tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    return LoadedModel(model, mc, path, tok, tuple(sorted(eos)), device, next(model.parameters()).dtype)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, attention_backend: str, pool: KVPool) -> None:
        self.model, self.cfg = loaded.model, loaded.model_config
        self.device, self.dtype = loaded.device, loaded.dtype
        self.attn = create_backend(attention_backend, self.device, self.dtype, self.cfg.head_dim)
        self.pool = pool  # the row store: prefix rows and every running sequence's K/V

    def alloc_kv(self, n_positions: int) -> SeqKV:
        """Private K/V rows for one sequence of ``n_positions``, all layers. The scheduler's
        budget guarantees room for admitted requests' buffers."""
        kv = self.pool.alloc_seq(n_positions)
        if kv is None:
            raise RuntimeError(f"request K/V rows exhausted ({n_positions} positions asked)")
        return kv

    def free_kv(self, kv: SeqKV) -> None:
        self.pool.free_seq(kv)

    def forward(self, works: list[SeqWork]) -> list[torch.Tensor]:
        """One batched forward; returns fp32 logits per work, [len(work.logit_positions), V]."""
        fb = ForwardBatch(works, self.device, self.pool.store).build(self.cfg.n_layers)
        logits = self.model.forward_batch(fb, self.attn)
        ip = fb.logit_indptr
        return list(logits.split([ip[i + 1] - ip[i] for i in range(len(works))]))
