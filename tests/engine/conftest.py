"""Engine fixtures: a tiny random K3.1 model folder with a real byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from helpers import write_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A K3.1-architecture model (indexer, MTP, MXFP4 experts, AttnRes) with random weights and a tokenizer."""
    folder = tmp_path_factory.mktemp("k31-tiny")
    write_model(folder)
    return folder


@pytest.fixture(scope="session")
def kimi_linear_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kimi-linear-tiny")
    write_model(folder, "kimi-linear-tiny")
    return folder


@pytest.fixture(scope="session")
def narrow_experts_dir(tmp_path_factory):
    """Kimi-Linear-tiny with dense experts 40 wide, off MXFP8's blocks of 32."""
    folder = tmp_path_factory.mktemp("narrow-experts")
    write_model(folder, "kimi-linear-tiny", moe_intermediate_size=40)
    return folder


@pytest.fixture(scope="session")
def k3_replica_dir(tmp_path_factory):
    """A small replica of a published Kimi K3 checkpoint folder: K3's config layout, bf16 shards with an index,
    tiktoken.model with the published special-token table, no tokenizer.json (tests/replica.py)."""
    from replica import write_k3_replica

    folder = tmp_path_factory.mktemp("k3-replica")
    write_k3_replica(folder)
    return folder
