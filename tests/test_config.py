"""config.json parsing: the published configs, the schema round trip, and one clear error per bad field."""

from __future__ import annotations

import copy
import json

import pytest

from kestrel.config import KDA, MLA, ConfigError, config_file, load_config, parse_config, to_hf_dict
from kestrel.models.presets import PRESETS, tiny_config


def published(name: str) -> dict:
    return json.loads(config_file(name).read_text())


def test_k3_config():
    c = load_config("k3")
    assert c.layer_types.count(KDA) == 69 and c.layer_types.count(MLA) == 24
    assert c.mla_layers == [*range(3, 91, 4), 91, 92]
    assert (c.hidden_size, c.num_experts, c.num_experts_per_token, c.expert_dim) == (7168, 896, 16, 3584)
    assert c.experts_mxfp4 and c.kda_full_rank_output_gate and c.kda_gate_lower_bound == -5.0
    assert c.attn_res_block_size == 12 and c.hidden_act == "situ" and c.mla_output_gate
    assert c.kv_cache_dim == 576 and not c.has_indexer and c.eos_token_id == 163586


def test_k31_config_adds_the_indexer():
    c = load_config("k3.1-pro")
    assert c.architecture == "KimiK31ForConditionalGeneration"
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 2048)
    assert c.layer_types == load_config("k3").layer_types


def test_kimi_linear_48b_config():
    c = load_config("kimi-linear-48b")
    assert c.q_lora_rank is None and c.kda_gate_lower_bound is None and not c.kda_full_rank_output_gate
    assert c.attn_res_block_size is None and c.routed_scaling_factor == 2.446 and c.hidden_act == "silu"
    assert c.mla_layers == [3, 7, 11, 15, 19, 23, 26] and not c.experts_mxfp4


@pytest.mark.parametrize("name", [*PRESETS, "k3", "k3.1-pro", "kimi-linear-48b"])
def test_schema_round_trip(name):
    config = parse_config(tiny_config(name)) if name in PRESETS else load_config(name)
    assert parse_config(to_hf_dict(config)) == config


def test_transformers_layer_type_lists():
    raw = tiny_config("kimi-linear-tiny")
    del raw["linear_attn_config"]["kda_layers"], raw["linear_attn_config"]["full_attn_layers"]
    raw["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
    raw["mlp_layer_types"] = ["dense", "sparse", "sparse", "sparse"]
    assert parse_config(raw) == parse_config(tiny_config("kimi-linear-tiny"))


def k3_with(**changes) -> dict:
    raw = tiny_config("k3.1-tiny")
    for path, value in changes.items():
        node = raw
        *parents, leaf = path.split("__")
        for key in parents:
            node = node[key]
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return raw


@pytest.mark.parametrize("raw, field", [
    ({"model_type": "llama"}, "model_type"),
    ({"model_type": "kimi_k3"}, "text_config"),
    (k3_with(text_config__hidden_size="64"), "hidden_size"),
    (k3_with(text_config__num_hidden_layers=None), "num_hidden_layers"),
    (k3_with(text_config__linear_attn_config__kda_layers=[1, 2, 3, 4, 5]), "kda_layers"),
    (k3_with(text_config__linear_attn_config__kda_layers=[1, 2]), "kda_layers"),
    (k3_with(text_config__linear_attn_config__gate_lower_bound=1.0), "gate_lower_bound"),
    (k3_with(text_config__dsa_config__dsa_layers=[4]), "dsa_layers"),
    (k3_with(text_config__dsa_config__index_rope_head_dim=64), "index_rope_head_dim"),
    (k3_with(text_config__dsa_config=None), "dsa_config"),
    (k3_with(text_config__q_lora_rank=None), "q_lora_rank"),
    (k3_with(text_config__num_experts_per_token=9), "num_experts_per_token"),
    (k3_with(text_config__hidden_act="gelu"), "hidden_act"),
    (k3_with(text_config__mla_use_nope=False), "mla_use_nope"),
    (k3_with(text_config__num_key_value_heads=2), "num_key_value_heads"),
    (k3_with(text_config__quantization_config__format="nvfp4-pack-quantized"), "quantization_config.format"),
])
def test_bad_fields_name_the_field(raw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(copy.deepcopy(raw))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
