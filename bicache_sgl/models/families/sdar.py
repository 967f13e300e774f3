"""SDAR (JetAstra SDAR-1.7B/4B/8B-Chat, ...): ``SDARForCausalLM``, model_type ``sdar``. A
Qwen3-style dense stack (separate q/k/v/o, QK-norm, full rotary, SwiGLU) trained for block
diffusion: block-causal attention, decoded block by block with its published
low_confidence_dynamic threshold rule, the only algorithm it accepts: ``low_confidence``
(SGLang's LowConfidence; token editing is LLaDA2.1's and is refused). Served by the
block-diffusion engine; prefix reuse is exact. docs/block_diffusion.md.
"""

from __future__ import annotations

from ...decoding.plan import FamilyDecoding
from ..block_config import EOS_ID_DEFAULTS, MASK_ID_DEFAULTS, SDAR_ARCHS
from . import _block
from .base import Family

NAME = "sdar"

FAMILY = Family(name=NAME, architectures=SDAR_ARCHS, model_types=("sdar",), parse=_block.parse,
                tensor_names=_block.tensor_names,
                decoding=FamilyDecoding(NAME, "low_confidence", ("low_confidence",), algorithm_config=True),
                prefix_reuse="exact", mask_token_id=MASK_ID_DEFAULTS[NAME], eos_token_ids=(EOS_ID_DEFAULTS[NAME],))
