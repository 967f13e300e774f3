"""Self-test rows of the block-diffusion families (random tiny checkpoints in the real LLaDA2 /
SDAR formats, built in a temporary folder):

- block-causal forward vs float64: the runtime's forward against ``reference.reference_block_logits``
  (relative to the logits' scale, as the depth-d rows are judged);
- exact reuse == cache off: two requests sharing a prefix (not block-aligned), the second reusing
  the first's whole blocks, give the tokens of a cache-off engine, with the reused span a block
  multiple at full depth.
"""

from __future__ import annotations

import torch

from ..blockdiff.engine import BlockEngine, BlockEngineOptions, BlockParams
from ..models.block_model import load_block_model
from ..reference import load_block_reference, reference_block_logits
from .report import FAIL, PASS, Row

SECTION = "exactness"
FP32_RELATIVE_TOL = 1e-4


def check_block_forward(folder: str, label: str, device: torch.device) -> Row:
    name = f"block-causal forward vs float64 ({label})"
    model = load_block_model(folder, device=device)
    B = model.cfg.decode.block_length
    ids = torch.randint(0, 256, (3 * B + 2,), generator=torch.Generator().manual_seed(0)).tolist()
    want = reference_block_logits(load_block_reference(folder), ids, B)
    got = model.forward_dense(torch.tensor(ids, device=device)).double().cpu()
    rel = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    detail = f"max |runtime - float64| / scale = {rel:.1e} over {len(ids)} positions, blocks of {B}"
    return Row(SECTION, name, PASS if rel <= FP32_RELATIVE_TOL else FAIL, detail)


def check_block_reuse(folder: str, label: str, device: torch.device) -> Row:
    name = f"exact block reuse == cache off ({label})"
    model = load_block_model(folder, device=device)
    B, L = model.cfg.decode.block_length, model.cfg.n_layers
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 256, (3 * B + 1,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (3,), generator=g).tolist() for _ in range(2)]
    params = BlockParams(max_new_tokens=2 * B)
    on = BlockEngine(model, BlockEngineOptions(prefix_cache=True))
    got = [on.run([p], params)[0] for p in prompts]
    off = [BlockEngine(model, BlockEngineOptions(prefix_cache=False)).run([p], params)[0] for p in prompts]
    R, depth = got[1].meta["cached_tokens"], got[1].meta["bicache_depth"]
    same = sum(a.tokens == b.tokens for a, b in zip(got, off))
    detail = f"{same}/2 answers equal to cache off; second request reused {R} tokens (blocks of {B}) at depth {depth}"
    ok = same == 2 and R == 3 * B and depth == L
    return Row(SECTION, name, PASS if ok else FAIL, detail)
