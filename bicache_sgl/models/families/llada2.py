"""LLaDA2.x (inclusionAI LLaDA2.0-mini / -flash, LLaDA2.1-mini): ``LLaDA2MoeModelLM``, model_type
``llada2_moe``. Block-causal attention (blocks from position 0), fused query_key_value, QK-norm,
partial rotary; MoE FFN with sigmoid scores + expert bias, grouped top-k, shared experts and a
routed scaling factor after ``first_k_dense_replace`` dense layers. Served by the block-diffusion
engine (``bicache_sgl/blockdiff``) with its published per-block threshold decoding
(``low_confidence``, SGLang's LowConfidence, the default) or LLaDA2.1's token editing
(``joint_threshold``, SGLang's JointThreshold: ``--dllm-algorithm JointThreshold``, or the
checkpoint's generation_config.json); both take ``--dllm-algorithm-config``. Prefix reuse is exact
(whole blocks, full depth). docs/block_diffusion.md.
"""

from __future__ import annotations

from ...config import BLOCK_ALGORITHMS
from ...decoding.plan import FamilyDecoding
from ..block_config import EOS_ID_DEFAULTS, LLADA2_ARCHS, MASK_ID_DEFAULTS
from . import _block
from .base import Family

NAME = "llada2"

FAMILY = Family(name=NAME, architectures=LLADA2_ARCHS, model_types=("llada2_moe",), parse=_block.parse,
                tensor_names=_block.tensor_names,
                decoding=FamilyDecoding(NAME, "low_confidence", BLOCK_ALGORITHMS, algorithm_config=True),
                prefix_reuse="exact", mask_token_id=MASK_ID_DEFAULTS[NAME], eos_token_ids=(EOS_ID_DEFAULTS[NAME],))
