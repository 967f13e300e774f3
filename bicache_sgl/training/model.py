"""A plain-PyTorch LLaDA model for training (exactly LLaDA's math and weight names).

Parameter names mirror LLaDA's Hugging Face checkpoints (``model.transformer.*``),
so ``state_dict()`` can be written to ``model.safetensors`` as is and read back by
any LLaDA loader.  Forward math:

    x = wte[ids]
    per block:  h = x + attn_out(Attn(RMSNorm_attn(x)))
                x = h + ff_out(silu(ff_proj(n)) * up_proj(n)),  n = RMSNorm_ff(h)
    logits = lm_head(RMSNorm_f(x))   (lm_head = ff_out, or wte when weight_tying)

Attention is fully bidirectional, scaled by 1/sqrt(head_dim), with rotate-half RoPE
computed in fp32 at positions 0..N-1.  RMSNorm computes in fp32.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LLaDAConfig:
    d_model: int = 128
    n_layers: int = 8
    n_heads: int = 4
    n_kv_heads: int = 4
    mlp_hidden_size: int = 384
    max_sequence_length: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    vocab_size: int = 100
    embedding_size: int = 100
    mask_token_id: int = 1
    eos_token_id: int = 0
    pad_token_id: int = 0
    weight_tying: bool = False
    torch_dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_hf_dict(self) -> dict:
        d = asdict(self)
        d.update(
            architectures=["LLaDAModelLM"],
            model_type="llada",
            mlp_ratio=self.mlp_hidden_size / self.d_model,
            include_bias=False,
            include_qkv_bias=False,
            layer_norm_type="rms",
            activation_type="silu",
            block_type="llama",
            rope=True,
            scale_logits=False,
            use_cache=False,
        )
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "LLaDAConfig":
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(dtype) * self.weight


def rope_cos_sin(n: int, head_dim: int, theta: float, device=None):
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    pos = torch.arange(n, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()  # [n, head_dim] fp32


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(dtype)


class LLaDABlock(nn.Module):
    def __init__(self, cfg: LLaDAConfig):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ff_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(cfg.mlp_hidden_size, d, bias=False)

    def forward(self, x, cos, sin, attn_mask=None):
        b, n, _ = x.shape
        a = self.attn_norm(x)
        q = self.q_proj(a).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(a).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(a).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False,
                                           scale=1.0 / math.sqrt(self.head_dim))
        h = x + self.attn_out(o.transpose(1, 2).reshape(b, n, -1))
        m = self.ff_norm(h)
        return h + self.ff_out(F.silu(self.ff_proj(m)) * self.up_proj(m))


class LLaDAModelLM(nn.Module):
    def __init__(self, cfg: LLaDAConfig):
        super().__init__()
        self.config = cfg
        transformer = nn.Module()
        transformer.wte = nn.Embedding(cfg.embedding_size, cfg.d_model)
        transformer.blocks = nn.ModuleList([LLaDABlock(cfg) for _ in range(cfg.n_layers)])
        transformer.ln_f = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        if not cfg.weight_tying:
            transformer.ff_out = nn.Linear(cfg.d_model, cfg.embedding_size, bias=False)
        self.model = nn.Module()
        self.model.transformer = transformer

    def init_weights(self, generator: torch.Generator) -> None:
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
                nn.init.ones_(p)
            elif name.endswith("attn_out.weight") or (".blocks." in name and name.endswith("ff_out.weight")):
                nn.init.normal_(p, 0.0, out_std, generator=generator)
            else:
                nn.init.normal_(p, 0.0, std, generator=generator)

    def forward(self, input_ids: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        t = self.model.transformer
        x = t.wte(input_ids)
        cos, sin = rope_cos_sin(input_ids.shape[1], self.config.head_dim, self.config.rope_theta,
                                input_ids.device)
        for blk in t.blocks:
            x = blk(x, cos, sin, attn_mask)
        x = t.ln_f(x)
        w = t.wte.weight if self.config.weight_tying else t.ff_out.weight
        return F.linear(x, w)

    # ------------------------------------------------------------------ io
    def save_pretrained(self, folder: str, dtype: str | None = None) -> None:
        """Write config.json and model.safetensors (atomically, via temp files)."""
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        dtype = dtype or self.config.torch_dtype
        tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        sd = {k: v.detach().to(tdtype).contiguous().clone() for k, v in self.state_dict().items()}
        cfg = self.config.to_hf_dict()
        cfg["torch_dtype"] = dtype
        tmp_w = os.path.join(folder, "model.safetensors.tmp")
        save_file(sd, tmp_w, metadata={"format": "pt"})
        os.replace(tmp_w, os.path.join(folder, "model.safetensors"))
        tmp_c = os.path.join(folder, "config.json.tmp")
        with open(tmp_c, "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        os.replace(tmp_c, os.path.join(folder, "config.json"))

    @classmethod
    def from_pretrained(cls, folder: str) -> "LLaDAModelLM":
        from safetensors.torch import load_file

        with open(os.path.join(folder, "config.json")) as f:
            cfg = LLaDAConfig.from_hf_dict(json.load(f))
        model = cls(cfg)
        sd = load_file(os.path.join(folder, "model.safetensors"))
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
        return model


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
