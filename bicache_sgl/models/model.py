"""One native torch implementation for every registered model family (models/families/).

All are pre-norm Llama-style stacks with bidirectional attention: RMSNorm, RoPE (rotate-half,
applied in fp32), a SwiGLU FFN or a mixture of SwiGLU experts (LLaDA-MoE). They differ in tensor
names, biases, GQA, QK-norm, the FFN and Dream's logit shift, all captured by ModelConfig (the
family's parse) and the family's tensor-name map.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.base import AttentionBackend
from ..attention.torch_backend import sdpa_batched
from .config import ModelConfig, MoESpec
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


def _fuse_rows(parts: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input, stacked by output rows;
    each projection's weight becomes a view into it, so memory does not grow and a later
    in-place load into either stays visible to both."""
    w = torch.cat([p.weight.data for p in parts], dim=0)
    b = torch.cat([p.bias.data for p in parts], dim=0) if parts[0].bias is not None else None
    off = 0
    for p in parts:
        n = p.weight.shape[0]
        p.weight = nn.Parameter(w[off:off + n], requires_grad=False)
        if b is not None:
            p.bias = nn.Parameter(b[off:off + n], requires_grad=False)
        off += n
    return w, b


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), bias-free: one MoE expert, or a shared expert."""

    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)
        self._gate_up_w: torch.Tensor | None = None

    def fuse(self) -> None:
        if self._gate_up_w is None:
            self._gate_up_w, _ = _fuse_rows((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, D] -> [n, D]; one GEMM for gate/up once fused (same products, same rounding)."""
        if self._gate_up_w is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self._gate_up_w).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


def moe_ffn(x: torch.Tensor, router: nn.Linear, expert_bias: torch.Tensor | None, spec: MoESpec,
            experts: nn.ModuleList) -> torch.Tensor:
    """The routed experts' output for tokens x [n, D] (MoESpec): router logits in x's dtype,
    softmax in float32 (+ the expert bias), the top-k probabilities (renormalised only with
    ``norm_topk_prob``) cast to x's dtype weight each chosen expert's output.

    Batched: the n * top_k (token, expert) pairs are sorted by expert (stable), so each expert
    runs ONE GEMM over the contiguous run of its tokens (one pass over the experts, none over
    tokens; experts no token chose are skipped), and the weighted outputs are scattered back
    with one index_add_ (per token in ascending expert order, as the published loop adds them).
    The counts per expert cost one device -> host read per layer."""
    k = spec.top_k
    probs = router(x).float().softmax(dim=-1)  # [n, E]
    if expert_bias is not None:
        probs = probs + expert_bias.float()
    w, idx = probs.topk(k, dim=-1)  # [n, k]
    if spec.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    flat = idx.reshape(-1)  # [n * k]: pair j is token j // k
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=spec.n_experts).tolist()
    tok = order // k
    xs = x.index_select(0, tok)  # [n * k, D], grouped by expert
    outs, start = [], 0
    for e, c in enumerate(counts):
        if c:
            outs.append(experts[e](xs[start:start + c]))
            start += c
    ys = torch.cat(outs) if outs else xs[:0]
    ys = ys * w.reshape(-1).index_select(0, order).to(x.dtype)[:, None]
    return torch.zeros_like(x).index_add_(0, tok, ys)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        d, qd, kv, ff = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.kv_dim, cfg.intermediate_size
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, qd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kv, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(qd, d, bias=cfg.o_bias)
        # QK-norm (LLaDA-MoE): an RMSNorm over each head's q and k, before RoPE
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.moe = cfg.moe if cfg.is_moe_layer(index) else None
        if self.moe is None:  # dense SwiGLU
            self.gate_proj = nn.Linear(d, ff, bias=cfg.mlp_bias)
            self.up_proj = nn.Linear(d, ff, bias=cfg.mlp_bias)
            self.down_proj = nn.Linear(ff, d, bias=cfg.mlp_bias)
        else:  # router, experts, optional expert bias and shared expert (MoESpec)
            m = self.moe
            self.router = nn.Linear(d, m.n_experts, bias=False)
            self.experts = nn.ModuleList(SwiGLU(d, m.expert_size) for _ in range(m.n_experts))
            self.expert_bias = nn.Parameter(torch.zeros(m.n_experts)) if m.expert_bias else None
            self.shared_expert = SwiGLU(d, m.shared_expert_size) if m.shared_expert_size else None
        self._fused = False

    def fuse(self) -> None:
        """One GEMM for q/k/v and one for gate/up (fewer kernel launches per layer; per expert in
        a MoE layer). The separate projections' weights become views into the fused tensors, so
        memory does not grow and a later in-place load into either stays visible to both. Done
        once, after loading: the checkpoint format is unchanged."""
        if self._fused:
            return
        self._qkv_w, self._qkv_b = _fuse_rows((self.q_proj, self.k_proj, self.v_proj))
        if self.moe is None:
            self._gate_up_w, self._gate_up_b = _fuse_rows((self.gate_proj, self.up_proj))
            self._down_wt = self.down_proj.weight.data.t() if self.down_proj.bias is None else None
        else:
            for ex in self.experts:
                ex.fuse()
            if self.shared_expert is not None:
                self.shared_expert.fuse()
        # [in, out] views for addmm(residual, x, w_t): the residual add happens inside the GEMM
        # (one op instead of linear + add); None where a bias must be added first
        self._o_wt = self.o_proj.weight.data.t() if self.o_proj.bias is None else None
        self._fused = True

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[n, D] -> [n, (H + 2 Hkv) * Dh]."""
        return F.linear(x, self._qkv_w, self._qkv_b)

    def attn_residual(self, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """h [n, D] + o_proj(a [n, H * Dh])."""
        if self._o_wt is None:
            return h + self.o_proj(a)
        return torch.addmm(h, a, self._o_wt)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN of the normalised residual x [..., D] with the separate projections
        (differentiable; the dense forward): SwiGLU, or the routed experts (+ the shared one)."""
        if self.moe is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        flat = x.reshape(-1, x.shape[-1])
        out = moe_ffn(flat, self.router, self.expert_bias, self.moe, self.experts)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.view(x.shape)

    def mlp_residual(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, D] + FFN(ffn_norm(h)), with the fused GEMMs."""
        if self.moe is not None:
            return h + self.ffn(self.ffn_norm(h))
        gate, up = F.linear(self.ffn_norm(h), self._gate_up_w, self._gate_up_b).chunk(2, dim=-1)
        act = F.silu(gate).mul_(up)
        if self._down_wt is None:
            return h + self.down_proj(act)
        return torch.addmm(h, act, self._down_wt)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DiffusionLM(nn.Module):
    """The diffusion LM of any registered family, with a packed, cache-aware forward (``forward_batch``, serving) and a
    plain dense one (``forward``: batched and differentiable, used for training; ``forward_dense``:
    one sequence without autograd, used for calibration and checks)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
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
        if layer.q_norm is None:
            qk = self.apply_rope(qkv[:, :H + Hkv], rope)
        else:
            qk = self.apply_rope(torch.cat([layer.q_norm(qkv[:, :H]), layer.k_norm(qkv[:, H:H + Hkv])], dim=1), rope)
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
            q = layer.q_proj(x).view(B, N, cfg.n_heads, cfg.head_dim)
            k = layer.k_proj(x).view(B, N, cfg.n_kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = self.apply_rope(q, rope), self.apply_rope(k, rope)
            v = layer.v_proj(x).view(B, N, cfg.n_kv_heads, cfg.head_dim)
            if return_states:
                states.append((h, k, v))
            h = h + layer.o_proj(sdpa_batched(q, k, v, attn_mask).reshape(B, N, -1))
            h = h + layer.ffn(layer.ffn_norm(h))
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
