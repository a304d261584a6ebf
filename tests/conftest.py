"""Shared fixtures: tiny random models of each family member."""

from __future__ import annotations

import pytest

from helpers import FAMILY, tiny_model


@pytest.fixture(params=FAMILY)
def family_model(request):
    """(model, raw config) for each of kimi_linear, K3 and K3.1."""
    return tiny_model(request.param)
