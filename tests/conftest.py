import os
import tempfile

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# First-run bicache profiles are cached on disk: keep the suite's own cache (inherited by the
# servers it starts) out of the user's ~/.cache and shared by every test of the session.
os.environ.setdefault("BICACHE_SGL_CACHE", tempfile.mkdtemp(prefix="bicache-sgl-test-cache-"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny models (all per-op overhead: OpenMP waits cost far
    more than they save on a shared machine); the count is restored after the module. A module
    opts in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llada(tmp_path_factory) -> str:
    from bicache_sgl.testing import make_tiny_llada
    return make_tiny_llada(tmp_path_factory.mktemp("llada"))


@pytest.fixture(scope="session")
def tiny_dream(tmp_path_factory) -> str:
    from bicache_sgl.testing import make_tiny_dream
    return make_tiny_dream(tmp_path_factory.mktemp("dream"))


@pytest.fixture(scope="session")
def tiny_llada_sharded(tmp_path_factory) -> str:
    from bicache_sgl.testing import make_tiny_llada
    return make_tiny_llada(tmp_path_factory.mktemp("llada_sharded"), shards=3, seed=1)


@pytest.fixture(scope="session")
def tiny_dream_sharded(tmp_path_factory) -> str:
    from bicache_sgl.testing import make_tiny_dream
    return make_tiny_dream(tmp_path_factory.mktemp("dream_sharded"), shards=2, seed=2)


@pytest.fixture(scope="session")
def tiny_llada_moe(tmp_path_factory) -> str:
    from bicache_sgl.testing import make_tiny_llada_moe
    return make_tiny_llada_moe(tmp_path_factory.mktemp("llada_moe"), n_layers=3)
