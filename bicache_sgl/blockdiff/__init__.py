"""Serving of the block-diffusion families (LLaDA2.x, SDAR): the block scheduler with the
families' natural K/V cache and the exact whole-block prefix cache (docs/block_diffusion.md)."""
