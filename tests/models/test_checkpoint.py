"""Checkpoint round trips, the family's name layouts, and one clear error for each kind of bad checkpoint."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import FAMILY, tiny_model
from kestrel.layers.batch import ForwardBatch
from kestrel.config import parse_config
from kestrel.models.checkpoint import INDEX_FILE, CheckpointError, build_model, load_model, save_model
from kestrel.models.init import init_weights
from kestrel.models.presets import tiny_config


def logits(model, seq_lens=(9, 30)):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (sum(seq_lens),), generator=gen)
    with torch.no_grad():
        return model.compute_logits(model(ids, ForwardBatch.build(list(seq_lens))))


def names(folder) -> dict[str, list[int]]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    return out


@pytest.mark.parametrize("preset", FAMILY)
@pytest.mark.parametrize("shard_bytes", [2**40, 200_000])
def test_save_then_load_gives_identical_logits(tmp_path, preset, shard_bytes):
    model, raw = tiny_model(preset)
    save_model(model, tmp_path, max_shard_bytes=shard_bytes, config_json=raw)
    assert (tmp_path / INDEX_FILE).exists() == (shard_bytes < 2**40)
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert torch.equal(logits(loaded), logits(model))


def test_k3_layout_names(tmp_path):
    model, raw = tiny_model("k3-tiny")
    save_model(model, tmp_path, config_json=raw)
    stored = names(tmp_path)
    assert all(n.startswith("language_model.") for n in stored)
    experts = "language_model.model.layers.1.block_sparse_moe.experts"
    assert stored[f"{experts}.7.w1.weight_packed"] == [32, 16]      # [out, in/2]
    assert stored[f"{experts}.7.w2.weight_scale"] == [32, 1]        # [out, in/32]
    assert stored["language_model.model.layers.0.self_attn.A_log"] == [32]   # zero-padded to head_dim
    assert "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in stored
    assert "language_model.model.output_attn_res_proj.weight" in stored
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["language_model.model.layers.0.self_attn.A_log"][2:].abs().sum() == 0
    assert tensors["language_model.model.layers.0.self_attn.dt_bias"].dtype == torch.float32


def test_k31_mtp_and_indexer_names(tmp_path):
    model, raw = tiny_model("k3.1-tiny")
    save_model(model, tmp_path, config_json=raw)
    stored = names(tmp_path)
    for name in ("layers.3.self_attn.indexer.wq_b.weight", "layers.3.self_attn.indexer.k_norm.weight",
                 "layers.6.eh_proj.weight", "layers.6.shared_head.head.weight", "layers.6.enorm.weight"):
        assert f"language_model.model.{name}" in stored
    assert "language_model.model.layers.3.self_attn.indexer.k_norm.bias" not in stored


def test_kimi_linear_a_log_layout(tmp_path):
    model, raw = tiny_model("kimi-linear-tiny")
    save_model(model, tmp_path, config_json=raw)
    assert names(tmp_path)["model.layers.0.self_attn.A_log"] == [1, 1, 2, 1]


def test_bf16_load_keeps_fp32_tensors(tmp_path):
    model, raw = tiny_model("k3-tiny")
    save_model(model, tmp_path, config_json=raw)
    loaded = load_model(tmp_path, dtype=torch.bfloat16)
    attn = loaded.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == torch.bfloat16
    assert {attn.A_log.dtype, attn.dt_bias.dtype, attn.q_conv1d.weight.dtype, attn.o_norm.weight.dtype} == {
        torch.float32}
    assert loaded.model.layers[1].block_sparse_moe.experts.w1_packed.dtype == torch.uint8


def rewrite(folder, edit):
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def test_vision_tensors_are_skipped_and_said_once(tmp_path, caplog):
    model, raw = tiny_model("k3-tiny")
    save_model(model, tmp_path, config_json=raw)
    rewrite(tmp_path, lambda t: t.update({"vision_tower.patch_embed.proj.weight": torch.zeros(4, 3, 2, 2),
                                          "mm_projector.proj.0.weight": torch.zeros(4, 4)}))
    with caplog.at_level(logging.INFO, logger="kestrel.models.checkpoint"):
        loaded = load_model(tmp_path, dtype=torch.float32)
    assert [r.getMessage() for r in caplog.records] == ["skipping 2 vision tensors: kestrel serves the text model"]
    assert torch.equal(logits(loaded), logits(model))


def test_unprefixed_k3_names_load(tmp_path):
    model, raw = tiny_model("k3-tiny")
    save_model(model, tmp_path, config_json=raw)
    rewrite(tmp_path, lambda t: t.update({k.removeprefix("language_model."): t.pop(k) for k in list(t)}))
    assert torch.equal(logits(load_model(tmp_path, dtype=torch.float32)), logits(model))


def test_mismatches_are_listed_in_one_error(tmp_path):
    model, raw = tiny_model("k3-tiny")
    save_model(model, tmp_path, config_json=raw)

    def damage(t):
        del t["language_model.model.norm.weight"]
        t["language_model.model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
        t["language_model.lm_head.weight"] = torch.zeros(3, 3)

    rewrite(tmp_path, damage)
    with pytest.raises(CheckpointError) as error:
        load_model(tmp_path)
    message = str(error.value)
    assert "1 missing: language_model.model.norm.weight" in message
    assert "1 unexpected: language_model.model.layers.0.self_attn.bogus.weight" in message
    assert "1 wrongly shaped: language_model.lm_head.weight [3, 3]" in message


def test_nonzero_a_log_padding_is_refused(tmp_path):
    model, raw = tiny_model("k3-tiny")
    save_model(model, tmp_path, config_json=raw)
    rewrite(tmp_path, lambda t: t["language_model.model.layers.0.self_attn.A_log"].fill_(1.0))
    with pytest.raises(CheckpointError, match="A_log"):
        load_model(tmp_path)


def test_truncated_file_is_a_clear_error(tmp_path):
    model, raw = tiny_model("kimi-linear-tiny")
    save_model(model, tmp_path, config_json=raw)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_model(tmp_path)


def test_missing_shard_is_named(tmp_path):
    model, raw = tiny_model("kimi-linear-tiny")
    save_model(model, tmp_path, max_shard_bytes=100_000, config_json=raw)
    shard = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]["lm_head.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        load_model(tmp_path)


def test_indexer_norm_bias_is_decided_by_the_checkpoint(tmp_path):
    raw = tiny_config("k3.1-tiny")
    raw["text_config"]["dsa_config"]["index_k_norm_bias"] = True
    model = init_weights(build_model(parse_config(raw), torch.float32), std=0.1)
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.bias.data.normal_()
    del raw["text_config"]["dsa_config"]["index_k_norm_bias"]
    save_model(model, tmp_path, config_json=raw)
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert loaded.config.index_k_norm_bias
    assert torch.equal(logits(loaded), logits(model))
