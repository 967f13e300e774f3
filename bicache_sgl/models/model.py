"""One native torch implementation for both supported diffusion LMs (LLaDA and Dream).

Both are pre-norm Llama-style stacks with bidirectional attention: RMSNorm, RoPE (rotate-half,
applied in fp32), SwiGLU MLP. They differ only in tensor names, biases, GQA and Dream's logit
shift, all captured by ModelConfig and models/weights.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.base import AttentionBackend
from ..attention.torch_backend import sdpa_batched
from .config import ModelConfig
from .forward_batch import ForwardBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32, cast back, then scale (the LLaDA / Qwen2 order of operations)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, qd, kv, ff = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.kv_dim, cfg.intermediate_size
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, qd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kv, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(qd, d, bias=cfg.o_bias)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, ff, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(d, ff, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(ff, d, bias=cfg.mlp_bias)
        self._fused = False

    def fuse(self) -> None:
        """One GEMM for q/k/v and one for gate/up (fewer kernel launches per layer). The separate
        projections' weights become views into the fused tensors, so memory does not grow and a
        later in-place load into either stays visible to both. Done once, after loading: the
        checkpoint format is unchanged."""
        if self._fused:
            return
        groups = (("qkv", (self.q_proj, self.k_proj, self.v_proj)), ("gate_up", (self.gate_proj, self.up_proj)))
        for name, parts in groups:
            w = torch.cat([p.weight.data for p in parts], dim=0)
            b = torch.cat([p.bias.data for p in parts], dim=0) if parts[0].bias is not None else None
            off = 0
            for p in parts:
                n = p.weight.shape[0]
                p.weight = nn.Parameter(w[off:off + n], requires_grad=False)
                if b is not None:
                    p.bias = nn.Parameter(b[off:off + n], requires_grad=False)
                off += n
            setattr(self, f"_{name}_w", w)
            setattr(self, f"_{name}_b", b)
        # [in, out] views for addmm(residual, x, w_t): the residual add happens inside the GEMM
        # (one op instead of linear + add); None where a bias must be added first
        self._o_wt = self.o_proj.weight.data.t() if self.o_proj.bias is None else None
        self._down_wt = self.down_proj.weight.data.t() if self.down_proj.bias is None else None
        self._fused = True

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[n, D] -> [n, (H + 2 Hkv) * Dh]."""
        return F.linear(x, self._qkv_w, self._qkv_b)

    def attn_residual(self, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """h [n, D] + o_proj(a [n, H * Dh])."""
        if self._o_wt is None:
            return h + self.o_proj(a)
        return torch.addmm(h, a, self._o_wt)

    def mlp_residual(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, D] + SwiGLU MLP(ffn_norm(h)), with the fused gate/up GEMM."""
        gate, up = F.linear(self.ffn_norm(h), self._gate_up_w, self._gate_up_b).chunk(2, dim=-1)
        act = F.silu(gate).mul_(up)
        if self._down_wt is None:
            return h + self.down_proj(act)
        return torch.addmm(h, act, self._down_wt)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DiffusionLM(nn.Module):
    """LLaDA / Dream transformer with a packed, cache-aware forward (``forward_batch``, serving) and a
    plain dense one (``forward``: batched and differentiable, used for training; ``forward_dense``:
    one sequence without autograd, used for calibration and checks)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._fused = False

    # ---- helpers -------------------------------------------------------------------------------
    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[n, D] final residual -> [n, V] fp32 logits."""
        x = self.norm(h)
        w = self.embed.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return F.linear(x, w).float()

    def rope_tables(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 tables [n_max, Dh], grown on demand: cos, sin, and the signed sin
        ``[-sin[:, :Dh/2], sin[:, Dh/2:]]`` of the roll form (``rope_for``)."""
        if self._rope is None or self._rope[0].shape[0] < n or self._rope[0].device != device:
            n_max = max(n, 2 * (self._rope[0].shape[0] if self._rope is not None else 0), 256)
            hd = self.cfg.head_dim
            inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
            t = torch.arange(n_max, dtype=torch.float32, device=device)
            emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
            cos, sin = emb.cos(), emb.sin()
            self._rope = (cos, sin, torch.cat([-sin[:, :hd // 2], sin[:, hd // 2:]], dim=-1))
        return self._rope

    def rope_for(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [n, 1, Dh] for positions ``pos`` (once per forward segment), such
        that rope(x) = x * cos + roll(x, Dh/2) * sin_signed == x * cos + rotate_half(x) * sin
        (the same products and sums, so the same rounding)."""
        cos_t, _, sin_t = self.rope_tables(int(pos.max()) + 1 if pos.numel() else 1, pos.device)
        return cos_t.index_select(0, pos).unsqueeze(1), sin_t.index_select(0, pos).unsqueeze(1)

    def apply_rope(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [n, heads, Dh] -> rotated x (computed in fp32, returned in x.dtype)."""
        cos, sin = rope
        xf = x if x.dtype == torch.float32 else x.float()
        out = xf * cos
        out += xf.roll(self.cfg.head_dim // 2, dims=-1) * sin
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def fuse(self) -> "DiffusionLM":
        """Fuse every layer's projections (``DecoderLayer.fuse``); idempotent, so the serving
        forward may call it every time."""
        if not self._fused:
            for layer in self.layers:
                layer.fuse()
            self._fused = True
        return self

    def _qkv(self, layer: DecoderLayer, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """q [n, H, Dh], k/v [n, Hkv, Dh]; RoPE on q and k in one pass over the fused output."""
        cfg = self.cfg
        H, Hkv = cfg.n_heads, cfg.n_kv_heads
        qkv = layer.qkv(layer.attn_norm(h)).view(-1, H + 2 * Hkv, cfg.head_dim)
        qk = self.apply_rope(qkv[:, :H + Hkv], rope)
        return qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]

    # ---- dense forward ------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, attn_mask: torch.Tensor | None = None, return_states: bool = False):
        """ids [B, N] -> fp32 logits [B, N, V] (unshifted: row i is the output at position i), every
        position attending to every key that ``attn_mask`` ([B, 1, 1, N] bool, True = attend; None:
        all) allows. Plain and differentiable: it uses the separate projections and never fuses, so
        training runs through it. With return_states also returns per-layer (h_in [B, N, D],
        k [B, N, Hkv, Dh], v) lists."""
        cfg = self.cfg
        B, N = ids.shape
        rope = self.rope_for(torch.arange(N, device=ids.device))
        h = self.embed(ids)
        states = []
        for layer in self.layers:
            x = layer.attn_norm(h)
            q = self.apply_rope(layer.q_proj(x).view(B, N, cfg.n_heads, cfg.head_dim), rope)
            k = self.apply_rope(layer.k_proj(x).view(B, N, cfg.n_kv_heads, cfg.head_dim), rope)
            v = layer.v_proj(x).view(B, N, cfg.n_kv_heads, cfg.head_dim)
            if return_states:
                states.append((h, k, v))
            h = h + layer.o_proj(sdpa_batched(q, k, v, attn_mask).reshape(B, N, -1))
            x = layer.ffn_norm(h)
            h = h + layer.down_proj(F.silu(layer.gate_proj(x)) * layer.up_proj(x))
        logits = self.lm_logits(h)
        return (logits, states) if return_states else logits

    @torch.no_grad()
    def forward_dense(self, ids: torch.Tensor, return_states: bool = False):
        """``forward`` for one sequence without autograd: ids [N] -> logits [N, V]; with
        return_states also per-layer (h_in [N, D], k [N, Hkv, Dh], v) lists."""
        logits, states = self.forward(ids[None], return_states=True)
        if not return_states:
            return logits[0]
        return logits[0], [(h[0], k[0], v[0]) for h, k, v in states]

    # ---- packed, cache-aware forward ----------------------------------------------------------
    @torch.no_grad()
    def forward_batch(self, fb: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Run one forward for every sequence in ``fb``; returns fp32 logits [len(fb.logit_rows), V]
        in sequence order (fb.logit_indptr). K/V are written to and read from ``fb.store``;
        captures go to prefix rows of the same store."""
        cfg, L, store = self.cfg, self.cfg.n_layers, fb.store
        self.fuse()
        attn.begin_forward([s.kv.rows for s in fb.seqs], (fb.kv_flat, fb.kv_indptr))
        seg_iter = iter(fb.segments)
        seg = next(seg_iter)
        next_seg = next(seg_iter, None)
        # gathers are index_select / index_copy_ on flat indices throughout: on CPU they copy whole
        # rows, several times faster than advanced indexing
        h = self.embed(fb.row_ids.index_select(0, seg.rows_t))
        rope = self.rope_for(fb.row_pos.index_select(0, seg.rows_t))
        kv_dtype = store.k.dtype
        for li, layer in enumerate(self.layers):
            if next_seg is not None and next_seg.start_layer == li:
                new_h = torch.empty(len(next_seg.rows), cfg.hidden_size, dtype=h.dtype, device=h.device)
                new_h.index_copy_(0, next_seg.join_into, h)
                new_h.index_copy_(0, next_seg.join_new, _as(next_seg.join_h, h.dtype))
                h, seg = new_h, next_seg
                next_seg = next(seg_iter, None)
                rope = self.rope_for(fb.row_pos.index_select(0, seg.rows_t))
            if li in fb.capture_h:  # residual leaving layer li - 1 of captured positions
                src, dst = fb.capture_h[li]
                store.h.index_copy_(0, dst, _as(h.index_select(0, src), store.h.dtype))
            q, k, v = self._qkv(layer, h, rope)
            # one write per layer for every computed row of every sequence
            wr = seg.write_rows[li - seg.start_layer]
            store.k.index_copy_(0, wr, _as(k, kv_dtype))
            store.v.index_copy_(0, wr, _as(v, kv_dtype))
            if li in fb.capture_kv:
                src, dst = fb.capture_kv[li]
                store.k.index_copy_(0, dst, _as(k.index_select(0, src), kv_dtype))
                store.v.index_copy_(0, dst, _as(v.index_select(0, src), kv_dtype))
            if li == L - 1:
                # The last layer's outputs matter only where logits are read: every other row
                # needed just its K/V (written above), so attention/MLP run on logit rows only.
                if len(fb.logit_rows) == 0:
                    return torch.empty(0, cfg.vocab_size, device=fb.device)
                if fb.logit_sel is not None:
                    q, h = q.index_select(0, fb.logit_sel), h.index_select(0, fb.logit_sel)
                q_indptr, layout = fb.logit_indptr, ("logits",)
            else:
                q_indptr, layout = seg.q_indptr, ("seg", seg.start_layer)
            a_out = attn.attend(q, store.k, store.v, li, q_indptr, layout)
            h = layer.mlp_residual(layer.attn_residual(h, a_out.reshape(q.shape[0], -1)))
        return self.lm_logits(h)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, without a dispatched no-op ``to`` when it already is."""
    return t if t.dtype == dtype else t.to(dtype)
