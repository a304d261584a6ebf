"""Shared fixtures: tiny random models of each family member.

Triton kernels run on the CPU through Triton's interpreter, which must be switched on before triton is first
imported (fla imports it too), so it is switched on here, before any test module loads.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import FAMILY, tiny_model  # noqa: E402


@pytest.fixture(params=FAMILY)
def family_model(request):
    """(model, raw config) for each of kimi_linear, K3 and K3.1."""
    return tiny_model(request.param)
