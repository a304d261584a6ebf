"""Model configuration: reads a Hugging Face `config.json` of the Kimi K3 family into one flat, checked dataclass.

Three schemas are understood:
- `kimi_linear` (Kimi-Linear-48B-A3B, and transformers' own `save_pretrained` output): text settings at top level.
- `kimi_k3` (Kimi K3): text settings nested in `text_config`; routed experts quantized per `quantization_config`.
- Kimi K3.1 Pro (`KimiK31ForConditionalGeneration`, also `model_type: kimi_k3`): K3 plus a lightning indexer
  on the full-attention layers, described by `dsa_config`.

Features are decided by the fields present, not by the model name, so a K3 `text_config` read on its own also works.
Where the public record is uncertain (model-spec.md section 11) the choice is documented on the field and can be
overridden by a key of the same name in config.json.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KDA = "kda"
MLA = "mla"


class ConfigError(ValueError):
    """A config.json that kestrel cannot serve; the message names the offending field."""


@dataclass(frozen=True)
class ModelConfig:
    """The text model's hyperparameters (checkpoint layer indices are 0-based here)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]            # KDA or MLA per layer
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    # KDA (linear attention)
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    kda_full_rank_output_gate: bool        # K3: g_proj [H*dv, hidden]; Kimi-Linear: g_a_proj/g_b_proj of rank head_dim
    kda_gate_lower_bound: float | None     # K3: g = lb * sigmoid(exp(A) (x + dt)); None: g = -exp(A) softplus(x + dt)

    # MLA (full attention, NoPE)
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_output_gate: bool
    # Uncertain (model-spec 11.5): vLLM uses rms_norm_eps for q_a/kv_a_layernorm, NeMo and transformers use 1e-6.
    # kestrel follows transformers and NeMo; config key `mla_norm_eps` overrides.
    mla_norm_eps: float

    # Lightning indexer (K3.1 "DSA"); index_topk == 0 means no indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # Uncertain (model-spec 5.3): DeepSeek-V3.2's k_norm LayerNorm has a bias; K3.1 counts four indexer tensors,
    # which suggests it has none. Default False; the loader switches it on when the checkpoint carries the bias.
    index_k_norm_bias: bool

    # MLP / MoE
    hidden_act: str                        # "silu" (SwiGLU) or "situ" (SiTU-GLU)
    situ_beta: float
    situ_linear_beta: float
    intermediate_size: int                 # dense MLP width (layers < first_k_dense_replace)
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None  # latent MoE width; None: experts run at hidden_size
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
    experts_mxfp4: bool                    # routed experts stored as MXFP4 (compressed-tensors mxfp4-pack-quantized)

    attn_res_block_size: int | None        # AttnRes block size; None: plain residual stream
    num_nextn_predict_layers: int          # MTP layers

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == MLA]

    @property
    def has_indexer(self) -> bool:
        return self.index_topk > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_dim(self) -> int:
        """Width the routed experts read and write (the latent width for a latent MoE)."""
        return self.routed_expert_hidden_size or self.hidden_size

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and self.num_experts > 0

    def stream_width(self, layer: int) -> int:
        """n of the residual stream [n, T, D] entering decoder layer `layer`: the AttnRes blocks finished before it
        plus the running partial sum (1, the hidden states, without AttnRes)."""
        size = self.attn_res_block_size
        return 1 if size is None else -(-layer // size) + 1

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per MLA layer: the normalised latent plus the shared key part (512 + 64)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


PUBLISHED_CONFIGS = {
    "k3": "kimi-k3.json",
    "k3.1-pro": "kimi-k3.1-pro.json",
    "kimi-linear-48b": "kimi-linear-48b-a3b.json",
}
"""Configs of the released models shipped with kestrel (kestrel/configs/), by short name."""


def config_file(path: str | Path) -> Path:
    """The config.json that `path` names: a model folder, a config file, or a PUBLISHED_CONFIGS name."""
    if str(path) in PUBLISHED_CONFIGS:
        return Path(__file__).parent / "configs" / PUBLISHED_CONFIGS[str(path)]
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        names = ", ".join(PUBLISHED_CONFIGS)
        raise ConfigError(f"{file} does not exist; give a model folder, a config.json or one of: {names}.")
    return file


def load_config(path: str | Path, **overrides: Any) -> ModelConfig:
    """Read `path` (see config_file) into a ModelConfig; `overrides` replace raw text-config keys."""
    file = config_file(path)
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON ({e}).") from e
    return parse_config(raw, **overrides)


def parse_config(raw: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Turn a parsed config.json into a ModelConfig, checking every field it uses."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object.")
    model_type = raw.get("model_type")
    architecture = _first(raw.get("architectures")) or ""
    if model_type == "kimi_k3":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("text_config: a kimi_k3 config must nest its text settings in a text_config object.")
        text = dict(text)
        for key in ("quantization_config", "dsa_config"):   # accepted at either level
            if key in raw and key not in text:
                text[key] = raw[key]
    elif model_type == "kimi_linear":
        text = dict(raw)
    else:
        raise ConfigError(f"model_type: {model_type!r} is not a Kimi K3 family model; kestrel serves "
                          "'kimi_linear' (Kimi-Linear) and 'kimi_k3' (Kimi K3, Kimi K3.1 Pro).")
    if architecture == "KimiK31ForConditionalGeneration" and "dsa_config" not in text:
        raise ConfigError("dsa_config: a KimiK31ForConditionalGeneration config must describe its indexer in "
                          "dsa_config.")
    text.update(overrides)
    return _TextConfigReader(text, architecture or model_type).read()


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else None


class _TextConfigReader:
    """Reads and checks the fields of a text config, naming the field in every error."""

    def __init__(self, text: dict[str, Any], architecture: str):
        self.text = text
        self.architecture = architecture

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., where: dict | None = None,
            prefix: str = "") -> Any:
        src = self.text if where is None else where
        if key not in src or src[key] is None:
            if default is ...:
                raise ConfigError(f"{prefix}{key}: missing from config.json.")
            return default
        value = src[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"{prefix}{key}: expected {names}, got {value!r}.")
        return value

    def positive(self, key: str, default: Any = ..., where: dict | None = None, prefix: str = "") -> int:
        value = self.get(key, int, default, where, prefix)
        if value <= 0:
            raise ConfigError(f"{prefix}{key}: must be positive, got {value}.")
        return value

    def read(self) -> ModelConfig:
        num_layers = self.positive("num_hidden_layers")
        hidden = self.positive("hidden_size")
        eps = self.get("rms_norm_eps", float, 1e-5)
        linear = self.get("linear_attn_config", dict, {})
        layer_types = self.layer_types(num_layers, linear)
        lp = "linear_attn_config."
        gate_lb = self.get("gate_lower_bound", float, None, linear, lp)
        if gate_lb is not None and gate_lb >= 0:
            raise ConfigError(f"{lp}gate_lower_bound: must be negative, got {gate_lb}.")
        if not self.get("mla_use_nope", bool, True):
            raise ConfigError("mla_use_nope: false asks for rotary MLA, which the Kimi K3 family does not use "
                              "and kestrel does not implement.")
        index = self.indexer(layer_types)
        if index["index_topk"] and not self.get("q_lora_rank", int, None):
            raise ConfigError("q_lora_rank: the lightning indexer reads the query latent, so dsa_config needs "
                              "q_lora_rank to be set.")
        act = self.get("hidden_act", str, "silu")
        if act not in ("silu", "situ"):
            raise ConfigError(f"hidden_act: {act!r} is not supported; expected 'silu' or 'situ'.")
        if self.get("moe_router_activation_func", str, "sigmoid") != "sigmoid":
            raise ConfigError("moe_router_activation_func: only 'sigmoid' routing is used by this family.")
        num_experts = self.get("num_experts", int, self.get("num_local_experts", int, 0))
        top_k = self.get("num_experts_per_token", int, self.get("num_experts_per_tok", int, 0))
        if num_experts and not 0 < top_k <= num_experts:
            raise ConfigError(f"num_experts_per_token: must be between 1 and num_experts ({num_experts}), "
                              f"got {top_k}.")
        groups = self.positive("num_expert_group", 1)
        topk_group = self.positive("topk_group", 1)
        if num_experts % groups or topk_group > groups:
            raise ConfigError(f"num_expert_group: {groups} groups with topk_group {topk_group} do not divide "
                              f"{num_experts} experts.")
        heads = self.positive("num_attention_heads")
        kv_heads = self.get("num_key_value_heads", int, heads)
        if kv_heads != heads:
            raise ConfigError(f"num_key_value_heads: MLA uses one latent for all heads; expected {heads}, "
                              f"got {kv_heads}.")
        block = self.get("attn_res_block_size", int, None)
        if block is not None and block <= 0:
            raise ConfigError(f"attn_res_block_size: must be positive, got {block}.")
        return ModelConfig(
            architecture=self.architecture,
            vocab_size=self.positive("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            layer_types=layer_types,
            rms_norm_eps=eps,
            max_position_embeddings=self.positive(
                "max_position_embeddings", self.get("model_max_length", int, 1 << 20)),
            tie_word_embeddings=self.get("tie_word_embeddings", bool, False),
            bos_token_id=self.get("bos_token_id", int, None),
            eos_token_id=self.eos_token_id(),
            pad_token_id=self.get("pad_token_id", int, None),
            kda_num_heads=self.positive("num_heads", self.get("linear_num_heads", int, 32), linear, lp),
            kda_head_dim=self.positive("head_dim", self.get("linear_head_dim", int, 128), linear, lp),
            conv_kernel_size=self.positive(
                "short_conv_kernel_size", self.get("linear_conv_kernel_dim", int, 4), linear, lp),
            kda_full_rank_output_gate=self.get("use_full_rank_gate", bool, False, linear, lp),
            kda_gate_lower_bound=gate_lb,
            num_attention_heads=heads,
            q_lora_rank=self.get("q_lora_rank", int, None),
            kv_lora_rank=self.positive("kv_lora_rank"),
            qk_nope_head_dim=self.positive("qk_nope_head_dim"),
            qk_rope_head_dim=self.get("qk_rope_head_dim", int, 0),
            v_head_dim=self.positive("v_head_dim"),
            mla_output_gate=self.get("mla_use_output_gate", bool, False),
            mla_norm_eps=self.get("mla_norm_eps", float, 1e-6),
            index_n_heads=index["index_n_heads"],
            index_head_dim=index["index_head_dim"],
            index_topk=index["index_topk"],
            index_k_norm_bias=index["index_k_norm_bias"],
            hidden_act=act,
            situ_beta=self.get("activation_situ_beta", float, 4.0),
            situ_linear_beta=self.get("activation_situ_linear_beta", float, 25.0),
            intermediate_size=self.positive("intermediate_size"),
            first_k_dense_replace=self.first_k_dense_replace(num_layers),
            num_experts=num_experts,
            num_experts_per_token=top_k,
            num_shared_experts=self.get("num_shared_experts", int, self.get("n_shared_experts", int, 0)),
            moe_intermediate_size=self.positive("moe_intermediate_size") if num_experts else 0,
            routed_expert_hidden_size=self.get("routed_expert_hidden_size", int, None),
            latent_moe_use_norm=self.get("latent_moe_use_norm", bool, False),
            routed_scaling_factor=self.get("routed_scaling_factor", float, 1.0),
            moe_renormalize=self.get("moe_renormalize", bool, self.get("norm_topk_prob", bool, True)),
            num_expert_group=groups,
            topk_group=topk_group,
            experts_mxfp4=self.experts_mxfp4(),
            attn_res_block_size=block,
            num_nextn_predict_layers=self.get("num_nextn_predict_layers", int, 0),
        )

    def eos_token_id(self) -> int | None:
        eos = self.text.get("eos_token_id")
        return _first(eos) if isinstance(eos, list) else self.get("eos_token_id", int, None)

    def layer_types(self, num_layers: int, linear: dict[str, Any]) -> tuple[str, ...]:
        """Layer kinds from linear_attn_config's 1-based lists, transformers' layer_types, or the K3 pattern."""
        lp = "linear_attn_config."
        if "kda_layers" in linear or "full_attn_layers" in linear:
            kda = self.layer_list("kda_layers", num_layers, linear, lp)
            full = self.layer_list("full_attn_layers", num_layers, linear, lp)
            both = set(kda) & set(full)
            if both:
                raise ConfigError(f"{lp}kda_layers: layers {sorted(both)} are also in full_attn_layers.")
            missing = set(range(1, num_layers + 1)) - set(kda) - set(full)
            if missing:
                raise ConfigError(f"{lp}kda_layers: layers {sorted(missing)} are in neither kda_layers nor "
                                  "full_attn_layers.")
            return tuple(MLA if i + 1 in full else KDA for i in range(num_layers))
        names = self.text.get("layer_types")
        if names is not None:
            kinds = {"linear_attention": KDA, "full_attention": MLA}
            if not isinstance(names, list) or len(names) != num_layers or any(n not in kinds for n in names):
                raise ConfigError(f"layer_types: expected {num_layers} entries of 'linear_attention' or "
                                  "'full_attention'.")
            return tuple(kinds[n] for n in names)
        return tuple(MLA if (i + 1) % 4 == 0 or i == num_layers - 1 else KDA for i in range(num_layers))

    def layer_list(self, key: str, num_layers: int, where: dict, prefix: str) -> list[int]:
        value = where.get(key, [])
        if not isinstance(value, list) or any(not isinstance(i, int) or not 1 <= i <= num_layers for i in value):
            raise ConfigError(f"{prefix}{key}: expected 1-based layer numbers between 1 and {num_layers}.")
        if len(set(value)) != len(value):
            raise ConfigError(f"{prefix}{key}: lists a layer twice.")
        return value

    def indexer(self, layer_types: tuple[str, ...]) -> dict[str, Any]:
        """The indexer fields of dsa_config (DeepSeek-V3.2 key names; model-spec 2.3)."""
        dsa = self.get("dsa_config", dict, None)
        if dsa is None:
            return {"index_n_heads": 0, "index_head_dim": 0, "index_topk": 0, "index_k_norm_bias": False}
        p = "dsa_config."
        if self.get("index_rope_head_dim", int, 0, dsa, p) != 0:
            raise ConfigError(f"{p}index_rope_head_dim: K3.1's indexer has no RoPE; kestrel supports only 0.")
        full = [i + 1 for i, t in enumerate(layer_types) if t == MLA]
        layers = dsa.get("dsa_layers", full)
        if sorted(layers) != full:
            raise ConfigError(f"{p}dsa_layers: must list exactly the full-attention layers {full}, got {layers}.")
        return {
            "index_n_heads": self.positive("index_n_heads", where=dsa, prefix=p),
            "index_head_dim": self.positive("index_head_dim", where=dsa, prefix=p),
            "index_topk": self.positive("index_topk", where=dsa, prefix=p),
            "index_k_norm_bias": self.get("index_k_norm_bias", bool, False, dsa, p),
        }

    def first_k_dense_replace(self, num_layers: int) -> int:
        kinds = self.text.get("mlp_layer_types")
        if kinds is not None:   # transformers' save_pretrained writes the expanded list
            if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
                raise ConfigError(f"mlp_layer_types: expected {num_layers} entries of 'dense' or 'sparse'.")
            dense = kinds.count("dense")
            if kinds[:dense] != ["dense"] * dense:
                raise ConfigError("mlp_layer_types: dense layers must come first.")
            return dense
        value = self.get("first_k_dense_replace", int, 1)
        if not 0 <= value <= num_layers:
            raise ConfigError(f"first_k_dense_replace: must be between 0 and {num_layers}, got {value}.")
        if self.get("moe_layer_freq", int, 1) != 1:
            raise ConfigError("moe_layer_freq: only 1 (every layer after the dense ones is MoE) is supported.")
        return value

    def experts_mxfp4(self) -> bool:
        quant = self.get("quantization_config", dict, None)
        if quant is None:
            return False
        q = "quantization_config."
        method, fmt = quant.get("quant_method"), quant.get("format")
        if method != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
            raise ConfigError(f"{q}format: only compressed-tensors 'mxfp4-pack-quantized' experts are supported, "
                              f"got quant_method={method!r}, format={fmt!r}.")
        for name, group in (quant.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if weights.get("group_size", 32) != 32 or weights.get("num_bits", 4) != 4:
                raise ConfigError(f"{q}config_groups.{name}.weights: MXFP4 needs num_bits 4 and group_size 32.")
            if group.get("input_activations"):
                raise ConfigError(f"{q}config_groups.{name}.input_activations: quantized activations are not "
                                  "stored in checkpoints of this family; expected null.")
        return True


K3_ARCHITECTURES = ("KimiK3ForConditionalGeneration", "KimiK31ForConditionalGeneration")


def is_k3_schema(config: ModelConfig) -> bool:
    """Whether checkpoints of this config use the K3 layout (nested text_config, `language_model.` names)."""
    return config.architecture in K3_ARCHITECTURES


def to_hf_dict(config: ModelConfig) -> dict[str, Any]:
    """The config.json that describes `config` in its family's schema (parse_config inverts it)."""
    one_based = lambda kind: [i + 1 for i, t in enumerate(config.layer_types) if t == kind]  # noqa: E731
    linear = {
        "num_heads": config.kda_num_heads,
        "head_dim": config.kda_head_dim,
        "short_conv_kernel_size": config.conv_kernel_size,
        "use_full_rank_gate": config.kda_full_rank_output_gate,
        "kda_layers": one_based(KDA),
        "full_attn_layers": one_based(MLA),
    }
    if config.kda_gate_lower_bound is not None:
        linear["gate_lower_bound"] = config.kda_gate_lower_bound
    text: dict[str, Any] = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "linear_attn_config": linear,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": config.mla_output_gate,
        "mla_norm_eps": config.mla_norm_eps,
        "hidden_act": config.hidden_act,
        "activation_situ_beta": config.situ_beta,
        "activation_situ_linear_beta": config.situ_linear_beta,
        "intermediate_size": config.intermediate_size,
        "first_k_dense_replace": config.first_k_dense_replace,
        "num_experts": config.num_experts,
        "num_experts_per_token": config.num_experts_per_token,
        "num_shared_experts": config.num_shared_experts,
        "moe_intermediate_size": config.moe_intermediate_size,
        "routed_expert_hidden_size": config.routed_expert_hidden_size,
        "latent_moe_use_norm": config.latent_moe_use_norm,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": config.routed_scaling_factor,
        "moe_renormalize": config.moe_renormalize,
        "num_expert_group": config.num_expert_group,
        "topk_group": config.topk_group,
        "attn_res_block_size": config.attn_res_block_size,
        "num_nextn_predict_layers": config.num_nextn_predict_layers,
    }
    if config.has_indexer:
        text["dsa_config"] = {
            "index_n_heads": config.index_n_heads,
            "index_head_dim": config.index_head_dim,
            "index_topk": config.index_topk,
            "index_rope_head_dim": 0,
            "index_k_norm_bias": config.index_k_norm_bias,
            "dsa_layers": one_based(MLA),
        }
    if config.experts_mxfp4:
        text["quantization_config"] = copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)
    if not is_k3_schema(config):
        return text
    return {
        "architectures": [config.architecture],
        "model_type": "kimi_k3",
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
        "text_config": text,
    }


MXFP4_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "group_size": 32, "strategy": "group", "symmetric": True, "type": "float",
                    "scale_dtype": "torch.uint8"},
        "input_activations": None,
    }},
    "kv_cache_scheme": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*", "re:.*routed_expert_.*",
               "re:.*block_sparse_moe\\.gate.*", "re:.*attn_res.*", "re:.*norm.*", "re:.*embed_tokens.*"],
}
