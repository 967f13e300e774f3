"""The block-diffusion transformer (LLaDA2.x MoE, SDAR dense): one native torch implementation.

Pre-norm stack: RMSNorm -> fused QKV -> per-head QK-norm -> RoPE on the first ``rotary_dim``
dims of each head (partial rotary, rotate-half inside that part, in fp32) -> block-causal
attention -> output projection; RMSNorm -> SwiGLU MLP or MoE (grouped top-k routing, shared
experts, routed scaling). Logits are unshifted (row i predicts token i).

The serving forward (``forward_rows``) computes a contiguous run of positions of each sequence
against a K/V buffer holding every earlier position (``BlockKV``): the rows' K/V are written at
their positions, attention reads the buffer's prefix, so a decode step computes only the rows it
names (the current block, plus a just-finished block whose final K/V is being committed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.block_causal import block_causal_attention
from .block_config import BlockModelConfig, block_checkpoint_names, detect_block_family, parse_block_config
from .model import RMSNorm, SwiGLU
from .spec import CheckpointError


def route(cfg: BlockModelConfig, router_logits: torch.Tensor, expert_bias: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped top-k routing as LLaDA2 publishes it. router_logits fp32 [T, E] ->
    (expert ids long [T, k], weights fp32 [T, k]).

    sigmoid: scores = sigmoid(logits); experts are *chosen* on scores + expert_bias (a group's score
    is the sum of its top-2 biased scores; the best ``topk_group`` groups stay eligible), the
    weights are the unbiased scores of the chosen experts. softmax: scores = softmax(logits), a
    group scores its best expert. Then renormalised to sum 1 (``norm_topk_prob``, k > 1) and
    multiplied by ``routed_scaling_factor``."""
    T, E = router_logits.shape
    G, k = cfg.n_group, cfg.num_experts_per_tok
    if cfg.score_function == "sigmoid":
        scores = torch.sigmoid(router_logits)
        choose = scores + expert_bias if expert_bias is not None else scores
        group_scores = choose.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)
    else:
        scores = torch.softmax(router_logits, dim=-1)
        choose = scores
        group_scores = choose.view(T, G, E // G).amax(dim=-1)
    if cfg.topk_group < G:
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        choose = choose.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    idx = choose.topk(k, dim=-1).indices
    w = scores.gather(1, idx)
    if cfg.norm_topk_prob and k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


class MoE(nn.Module):
    """Routed experts stacked per layer ([E, 2F, D] gate|up, [E, D, F] down) + shared experts.
    Tokens are grouped per expert with one sort; one pass over the experts that got tokens."""

    def __init__(self, cfg: BlockModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        E, d, ff = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Linear(d, E, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(E), requires_grad=False) if cfg.expert_bias else None
        self.w_gate_up = nn.Parameter(torch.empty(E, 2 * ff, d), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(E, d, ff), requires_grad=False)
        self.shared = SwiGLU(d, cfg.shared_intermediate_size * cfg.num_shared_experts) \
            if cfg.num_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]. The router runs in fp32 (as published); expert outputs are
        weighted and summed in fp32, then cast back to x's dtype before the shared experts add."""
        T = x.shape[0]
        bias = self.expert_bias.float() if self.expert_bias is not None else None
        idx, w = route(self.cfg, F.linear(x.float(), self.gate.weight.float()), bias)
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // k  # [T * k] token of each sorted (token, slot)
        w_sorted = w.reshape(-1).index_select(0, order)
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        # each (token, slot)'s weighted expert output, in expert-sorted order, then scattered back
        # to token-major order with one row copy and summed over the k slots (a fixed order per
        # token, whatever else is in the batch)
        ys = torch.empty(T * k, x.shape[1], dtype=torch.float32, device=x.device)
        ff = self.cfg.moe_intermediate_size
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            xs = x.index_select(0, token_of[start:start + n])
            gu = F.linear(xs, self.w_gate_up[e])
            y = F.linear(F.silu(gu[:, :ff]) * gu[:, ff:], self.w_down[e])
            ys[start:start + n] = y.float() * w_sorted[start:start + n, None]
            start += n
        out = torch.empty_like(ys).index_copy_(0, order, ys).view(T, k, -1).sum(1)
        y = out.to(x.dtype)
        if self.shared is not None:
            y = y + self.shared(x)
        return y


class BlockLayer(nn.Module):
    def __init__(self, cfg: BlockModelConfig, layer: int) -> None:
        super().__init__()
        d, hd, H, Hkv = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv = nn.Linear(d, (H + 2 * Hkv) * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * hd, d, bias=cfg.o_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.ffn: nn.Module = MoE(cfg) if cfg.is_moe_layer(layer) else SwiGLU(d, cfg.intermediate_size)


@dataclass
class BlockKV:
    """One sequence's K/V at every layer and position: k / v [L, capacity, Hkv, Dh]. Positions
    < ``committed`` hold final K/V (finished blocks); rows computed by a step are written at their
    positions too, and overwritten by the next step until their block is committed."""

    k: torch.Tensor
    v: torch.Tensor
    committed: int = 0

    @classmethod
    def empty(cls, cfg: BlockModelConfig, capacity: int, dtype: torch.dtype, device: torch.device) -> "BlockKV":
        shape = (cfg.n_layers, capacity, cfg.n_kv_heads, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


@dataclass
class RowsWork:
    """What one sequence computes in a forward: ``ids`` [m] at positions q_start .. q_start+m-1
    (every earlier position is in ``kv``); logits are returned for rows ``logit_from`` .. m-1."""

    ids: torch.Tensor
    q_start: int
    kv: BlockKV
    logit_from: int = 0
    block_length: int | None = None  # the sequence's block length (None: the model's decode default)


class BlockDiffusionLM(nn.Module):
    def __init__(self, cfg: BlockModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(BlockLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.attention = block_causal_attention  # (q, k, v, q_start, block_length) -> out

    # ---- pieces --------------------------------------------------------------------------------
    def rope_tables(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos / sin [n_max, rotary_dim] (frequencies over the rotary part only)."""
        if self._rope is None or self._rope[0].shape[0] < n or self._rope[0].device != device:
            n_max = max(n, 2 * (self._rope[0].shape[0] if self._rope is not None else 0), 256)
            rd = self.cfg.rotary_dim
            inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd))
            ang = torch.outer(torch.arange(n_max, dtype=torch.float32, device=device), inv)
            emb = torch.cat([ang, ang], dim=-1)
            self._rope = (emb.cos(), emb.sin())
        return self._rope

    def apply_rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [n, heads, Dh] -> rotated on dims [0, rotary_dim) (fp32), the rest passed through."""
        rd = self.cfg.rotary_dim
        cos_t, sin_t = self.rope_tables(int(pos.max()) + 1 if pos.numel() else 1, x.device)
        cos, sin = cos_t.index_select(0, pos)[:, None], sin_t.index_select(0, pos)[:, None]
        xr = x[..., :rd].float()
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        rot = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
        if rd == x.shape[-1]:
            return rot.to(x.dtype)
        return torch.cat([rot.to(x.dtype), x[..., rd:]], dim=-1)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.embed.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return F.linear(self.norm(h), w).float()

    # ---- forward -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_rows(self, work: list[RowsWork]) -> list[torch.Tensor]:
        """One packed forward over every sequence's rows. Writes the rows' K/V into each
        ``kv`` at their positions (every layer); returns fp32 logits [m - logit_from, V] per
        sequence. The last layer runs attention / FFN on logit rows only (the other rows needed
        just their K/V)."""
        cfg = self.cfg
        H, Hkv, hd, B, L = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.decode.block_length, cfg.n_layers
        dev = self.embed.weight.device
        lens = [int(w.ids.shape[0]) for w in work]
        offs = [0]
        for n in lens:
            offs.append(offs[-1] + n)
        ids = torch.cat([w.ids.to(dev) for w in work])
        pos = torch.cat([torch.arange(w.q_start, w.q_start + n, device=dev) for w, n in zip(work, lens)])
        for w, n in zip(work, lens):
            if w.q_start + n > w.kv.capacity:
                raise ValueError(f"rows up to position {w.q_start + n} exceed the K/V capacity {w.kv.capacity}")
        h = self.embed(ids)
        # rows kept at the last layer: each sequence's logit rows
        keep = torch.cat([torch.arange(offs[i] + w.logit_from, offs[i + 1], device=dev) for i, w in enumerate(work)])
        for li, layer in enumerate(self.layers):
            x = layer.attn_norm(h)
            qkv = layer.qkv(x).view(-1, H + 2 * Hkv, hd)
            q, k, v = qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:]
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = self.apply_rope(q, pos), self.apply_rope(k, pos)
            last = li == L - 1
            outs = []
            for i, w in enumerate(work):
                a, b = offs[i], offs[i + 1]
                end = w.q_start + lens[i]
                w.kv.k[li, w.q_start:end] = k[a:b].to(w.kv.k.dtype)
                w.kv.v[li, w.q_start:end] = v[a:b].to(w.kv.v.dtype)
                qa = a + w.logit_from if last else a
                if qa == b:
                    continue
                o = self.attention(q[qa:b], w.kv.k[li, :end].to(q.dtype), w.kv.v[li, :end].to(q.dtype),
                                   w.q_start + (qa - a), w.block_length or B)
                outs.append(o)
            if last:
                if keep.numel() == 0:
                    return [torch.empty(0, cfg.vocab_size, device=dev) for _ in work]
                h = h.index_select(0, keep)
            a_out = torch.cat(outs).reshape(h.shape[0], H * hd)
            h = h + layer.o_proj(a_out)
            h = h + layer.ffn(layer.ffn_norm(h))
        logits = self.lm_logits(h)
        out, at = [], 0
        for w, n in zip(work, lens):
            m = n - w.logit_from
            out.append(logits[at:at + m])
            at += m
        return out

    @torch.no_grad()
    def forward_dense(self, ids: torch.Tensor, block_length: int | None = None) -> torch.Tensor:
        """ids [N] -> fp32 logits [N, V], the whole sequence block-causally (blocks of
        ``block_length`` from 0; None: the model's)."""
        w = self.embed.weight
        kv = BlockKV.empty(self.cfg, int(ids.shape[0]), w.dtype, w.device)
        return self.forward_rows([RowsWork(ids, 0, kv, block_length=block_length)])[0]


def with_block_length(cfg: BlockModelConfig, block_length: int) -> BlockModelConfig:
    """The same model with another block length in its decode defaults (a served override)."""
    import dataclasses
    return dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, block_length=block_length))


def _with_generation_defaults(cfg: BlockModelConfig, path: Path, below: Mapping[str, Any],
                              above: Mapping[str, Any]) -> BlockModelConfig:
    """The decode defaults with any ``block_length`` / ``steps`` / ``threshold`` (and LLaDA2.1's
    ``edit_threshold`` / ``editing_threshold``, ``max_post_edit_steps`` / ``max_post_steps``) that the
    checkpoint's generation_config.json sets (a bad value is a CheckpointError naming it), over
    ``below`` (the chosen algorithm's own defaults) and under ``above`` (the server's flags)."""
    import dataclasses
    changes = dict(below)
    if path.exists():
        try:
            gen = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(gen, dict):
            raise CheckpointError(f"{path} must hold a JSON object")
        from_gen = {k: gen[k] for k in ("block_length", "steps", "threshold") if gen.get(k) is not None}
        for ours, names in (("edit_threshold", ("edit_threshold", "editing_threshold")),
                            ("max_post_edit_steps", ("max_post_edit_steps", "max_post_steps"))):
            for n in names:
                if gen.get(n) is not None:
                    from_gen[ours] = gen[n]
        try:
            dataclasses.replace(cfg.decode, **from_gen)
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: {e}") from e
        changes.update(from_gen)
    changes.update(above)
    if not changes:
        return cfg
    return dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, **changes))


def load_block_model(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     block_length: int | None = None, *, decode_defaults: Mapping[str, Any] | None = None,
                     decode_overrides: Mapping[str, Any] | None = None) -> BlockDiffusionLM:
    """A LLaDA2 / SDAR checkpoint folder (config.json + safetensors, single or sharded) -> model.
    CheckpointError names a missing or misshapen tensor. The decode defaults (``BlockDecodeDefaults``
    fields), lowest first: the family's published ones, ``decode_defaults`` (the server's chosen
    algorithm's own, e.g. SGLang's JointThreshold defaults), the checkpoint's generation_config.json,
    ``decode_overrides`` (the server's flags and algorithm config), then ``block_length``."""
    from safetensors import safe_open
    folder = Path(folder)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {folder / 'config.json'}: {e}") from e
    from .families import family_named
    from .special_ids import parse_with_special_ids
    if not isinstance(raw, dict) or detect_block_family(raw) is None:
        parse_block_config(raw if isinstance(raw, dict) else {}, name=folder.name)  # raises, naming what is wrong
    fam = family_named(detect_block_family(raw))
    # the special ids as the published code reads them (the one reader of every family)
    cfg = parse_with_special_ids(folder, raw, lambda c: parse_block_config(c, name=folder.name), fam.name,
                                 fam.mask_token_id, fam.eos_token_ids)
    cfg = _with_generation_defaults(cfg, folder / "generation_config.json", decode_defaults or {},
                                    decode_overrides or {})
    if block_length is not None:
        cfg = with_block_length(cfg, block_length)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors files")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for key in sf.keys():  # noqa: SIM118 (safe_open is not iterable)
                where[key] = f
    names = block_checkpoint_names(cfg)
    missing = [ck for ck, _ in names.values() if ck not in where]
    if missing:
        raise CheckpointError(f"{folder}: the checkpoint lacks tensor {missing[0]}" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    model = BlockDiffusionLM(cfg)
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, str, tuple[int, ...]]]] = {}
    for ours, (ck, shape) in names.items():
        by_file.setdefault(where[ck], []).append((ours, ck, shape))
    for f, items in by_file.items():
        with safe_open(str(f), "pt") as sf:
            for ours, ck, shape in items:
                t = sf.get_tensor(ck)
                if tuple(t.shape) != shape:
                    raise CheckpointError(f"{f.name}: tensor {ck} has shape {tuple(t.shape)}, expected {shape}")
                tensors[ours] = t
    state = _runtime_state(cfg, tensors)
    model.load_state_dict(state, strict=True)
    model.to(device=device, dtype=dtype)
    for layer in model.layers:
        if isinstance(layer.ffn, MoE) and layer.ffn.expert_bias is not None:
            layer.ffn.expert_bias.data = layer.ffn.expert_bias.data.float()  # the router's bias stays fp32
    return model.eval()


def _runtime_state(cfg: BlockModelConfig, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (runtime names, experts one by one, SDAR's q/k/v apart) -> the model's
    state dict (experts stacked, q/k/v fused)."""
    out: dict[str, torch.Tensor] = {}
    for key in ("embed.weight", "norm.weight", "lm_head.weight"):
        if key in t:
            out[key] = t[key]
    for i in range(cfg.n_layers):
        o = f"layers.{i}."
        out[o + "attn_norm.weight"] = t[o + "attn_norm.weight"]
        out[o + "ffn_norm.weight"] = t[o + "ffn_norm.weight"]
        if cfg.family == "sdar":
            out[o + "qkv.weight"] = torch.cat([t[f"{o}{p}_proj.weight"] for p in "qkv"])
            if cfg.qkv_bias:
                out[o + "qkv.bias"] = torch.cat([t[f"{o}{p}_proj.bias"] for p in "qkv"])
        else:
            out[o + "qkv.weight"] = t[o + "qkv.weight"]
            if cfg.qkv_bias:
                out[o + "qkv.bias"] = t[o + "qkv.bias"]
        out[o + "o_proj.weight"] = t[o + "o_proj.weight"]
        if cfg.o_bias:
            out[o + "o_proj.bias"] = t[o + "o_proj.bias"]
        if cfg.qk_norm:
            out[o + "q_norm.weight"] = t[o + "q_norm.weight"]
            out[o + "k_norm.weight"] = t[o + "k_norm.weight"]
        if cfg.is_moe_layer(i):
            out[o + "ffn.gate.weight"] = t[o + "gate.weight"]
            if cfg.expert_bias:
                out[o + "ffn.expert_bias"] = t[o + "gate.expert_bias"]
            E = cfg.num_experts
            out[o + "ffn.w_gate_up"] = torch.stack([
                torch.cat([t[f"{o}experts.{e}.gate_proj.weight"], t[f"{o}experts.{e}.up_proj.weight"]])
                for e in range(E)])
            out[o + "ffn.w_down"] = torch.stack([t[f"{o}experts.{e}.down_proj.weight"] for e in range(E)])
            if cfg.num_shared_experts:
                for p in ("gate_proj", "up_proj", "down_proj"):
                    out[f"{o}ffn.shared.{p}.weight"] = t[f"{o}shared.{p}.weight"]
        else:
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"{o}ffn.{p}.weight"] = t[f"{o}mlp.{p}.weight"]
    return out
