"""A one-command self-test for any device: ``python -m bicache_sgl.selftest`` (docs/selftest.md).

- ``battery``: the exactness checks (depth 0 == cache off, batched == alone, depth-d forward vs
  float64, FlashInfer == torch), each returning one ``report.Row``;
- ``depth_forward``: the harness that runs the packed depth-d forward against
  ``bicache_sgl.reference`` (also used by tests/test_fidelity.py);
- ``sizing``: the memory plan an engine would use here (bundled model, LLaDA-8B shape);
- ``probe``: cache off vs bicache throughput on the bundled model;
- ``cli``: arguments, the table, the exit status.

Importing this package imports none of them (the tests import ``depth_forward`` alone).
"""
