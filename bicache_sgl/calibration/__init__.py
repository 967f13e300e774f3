"""Calibration: build a bicache profile (prefix fraction r -> safe depth b) for a model from a prompt set.

    python -m bicache_sgl.calibrate --model-path M --data prompts.jsonl --out bicache_profile.json

For every sample and every prefix-fraction bucket r, the sequence is ``prompt tokens + G'
generation positions`` (all MASK). For a prompt, the shared prefix S is its first r * N tokens; a
prefix/suffix pair keeps S = its prefix and its question whole, and reaches r (at or just below the
bucket) through G' alone, never by cutting the question (``data.plan_task``). Two states of S are
compared layer by layer:

- cached (``--cached-context``): ``first_request`` (default) = S inside another request's own
  forward (S + a different question of the data set + its MASK region), which is what the runtime
  stores when the request that first computed S inserts it; ``prefix_only`` = S alone (what an
  explicit ``cache_prefix`` request, ``max_new_tokens: 0``, stores);
- in context: the target request's whole sequence through the model, sliced to S.

Criteria: ``kv-cosine`` (per-layer K/V cosine against --threshold) and ``agreement`` (greedy
decoding through the real runtime, a ``naive`` prefix cache on the loaded model, at every depth
0..L against cache-off). Both err safe: a depth passes only when every smaller depth passes, and the
table at r never exceeds a bucket measured at or above r. See docs/calibration.md.

Layering: this package sits BELOW the engine (the engine calls ``auto.resolve_profile`` at
start-up) and never imports ``bicache_sgl.engine``: the agreement meter runs requests on a
measurement stack that its caller builds on the already loaded model (duck-typed,
``driver.MeasureStack``; ``bicache_sgl.engine.engine.measurement_stack`` builds one), so the weights
are loaded once. The command line is ``bicache_sgl/calibrate.py``, above the engine.
``bicache_sgl.bicache`` (profile, policy) sits below this package and never imports it.

Modules: ``driver`` (THE measurement driver: items, meters, the budgeted loop with its progress,
tallies; the command line and ``auto`` are its two front ends), ``data`` (jsonl records, tokens,
planning of (sample, bucket) tasks and of the first request's context), ``synth`` (prompts
synthesised from a tokenizer), ``measure`` (the meters and the depth rules), ``auto`` (the first-run
profile: budget, stages, log), ``profile_cache`` (its cache on disk: location, checkpoint
fingerprint), ``plot`` (the PNG), ``rederive`` (an exact profile's per-generation-mode tables
rewritten from the counts it carries: ``python -m bicache_sgl.calibration.rederive FILE``).
"""

from .data import (
                   CACHED_CONTEXTS,
                   DEFAULT_CACHED_CONTEXT,
                   DEFAULT_FRACTIONS,
                   DEFAULT_PAIR_TOLERANCE,
                   DataError,
                   Record,
                   Sample,
                   Task,
                   first_request_rest,
                   gen_candidates,
                   plan_task,
                   plan_tasks,
                   read_data,
                   tokenize,
)
from .measure import (
                   DEPTH_RULES,
                   AgreementMeter,
                   SimilarityMeter,
                   depth_from_agreement,
                   depth_from_similarity,
                   kv_cosine_profile,
                   safe_table,
                   token_agreement,
                   token_cosine,
)

__all__ = [
    "CACHED_CONTEXTS", "DEFAULT_CACHED_CONTEXT", "DEFAULT_FRACTIONS", "DEFAULT_PAIR_TOLERANCE", "DEPTH_RULES",
    "AgreementMeter", "DataError", "Record", "Sample", "SimilarityMeter", "Task", "depth_from_agreement",
    "depth_from_similarity", "first_request_rest", "gen_candidates", "kv_cosine_profile", "plan_task", "plan_tasks",
    "read_data", "safe_table", "token_agreement", "token_cosine", "tokenize",
]
