"""kestrel serve on the CPU leaves a core to its event loop: torch's intra-op threads one fewer, unless
OMP_NUM_THREADS names them, never below one, and never on another device."""

from __future__ import annotations

import pytest
import torch

from kestrel.server.serve import leave_a_core_to_the_front_end


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("device, omp, start, expected", [
    ("cpu", None, 4, 3), ("cpu", None, 2, 1), ("cpu", None, 1, 1), ("cpu", "4", 4, 4), ("cuda", None, 4, 4),
])
def test_one_core_is_left_to_the_front_end(device, omp, start, expected, threads, monkeypatch):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    torch.set_num_threads(start)
    leave_a_core_to_the_front_end(device)
    assert torch.get_num_threads() == expected
