"""``python -m bicache_sgl.selftest``: see bicache_sgl/selftest/cli.py and docs/selftest.md."""

import sys

from .cli import main

sys.exit(main())
