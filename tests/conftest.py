"""Shared fixtures: tiny random models of each family member.

Triton kernels run on the CPU through Triton's interpreter, which must be switched on before triton is first
imported (fla imports it too), so it is switched on here, before any test module loads.

Property-based tests run derandomized (the same examples every run, so no test passes or fails by luck);
`--hypothesis-profile random` draws new ones (tools/fuzz.sh), and every failure found stays as an @example.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# One torch thread per process (servers started by tests inherit it): the tests run tiny models on two shared
# cores, where a second intra-op thread mostly waits on the first (measured 2-4x slower under load).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

from helpers import FAMILY, tiny_model  # noqa: E402

settings.register_profile("derandomized", derandomize=True, database=None)
settings.register_profile("random", derandomize=False, database=None)
settings.load_profile("derandomized")
torch.set_num_threads(1)


@pytest.fixture(params=FAMILY)
def family_model(request):
    """(model, raw config) for each of kimi_linear, K3 and K3.1."""
    return tiny_model(request.param)


@pytest.fixture
def torch_paths():
    """kestrel's CPU kernels off for the test (`--disable-cpu-kernels`): every op takes its torch path."""
    from kestrel.ops import cpu

    cpu.set_enabled(False)
    yield
    cpu.set_enabled(True)
