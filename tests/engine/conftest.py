"""Engine fixtures: a tiny random K3.1 model folder with a real byte-level BPE tokenizer."""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from kestrel.config import parse_config
from kestrel.models.checkpoint import build_model, save_model
from kestrel.models.init import init_weights
from kestrel.models.presets import tiny_config

VOCAB = 320
SPECIALS = ["[PAD]", "[BOS]", "[EOS]"]          # ids 0, 1, 2
CORPUS = ["the quick brown fox jumps over the lazy dog", "to be or not to be, that is the question",
          "all the world's a stage, and all the men and women merely players", "héllo wörld, ça va? 你好世界 🙂"] * 20


def write_tokenizer(folder) -> None:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "add_bos_token": True}))


def write_model(folder, preset: str = "k3.1-tiny", seed: int = 0, **overrides) -> None:
    """A random model of `preset` (text-config keys replaced by overrides) and the test tokenizer in folder."""
    raw = tiny_config(preset)
    text = raw.get("text_config", raw)
    text.update(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, **overrides)
    model = init_weights(build_model(parse_config(raw), torch.float32), seed=seed, std=0.1)
    save_model(model, folder, config_json=raw)
    write_tokenizer(folder)


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
