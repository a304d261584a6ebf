"""Published DFlash drafts for the Kimi family: a few dense layers that propose a block of tokens in one non-causal
forward, their keys and values spanning the target's context as well as the block. Two layouts load:

- NVIDIA NeMo AutoModel's `KimiK3DFlashDraftModel` (K3 targets): K3 MLA layers (NoPE, Q-LoRA, output gate) and a
  SiTU MLP, under the K3 checkpoint's names; config.json is the target's text config with num_hidden_layers the
  draft's depth (it has kv_lora_rank);
- SpecForge's `DFlashDraftModel` (z-lab's DFlash, NeMo's Qwen3 draft; any target): Qwen3 attention (q_proj, k_proj,
  v_proj, o_proj, per-head q_norm and k_norm, grouped KV heads, RoPE) and a SiLU MLP.

For a sequence whose positions 0..p-1 the target has computed and whose token x_p is known (the anchor):

- the context: at every position s < p, c_s = hidden_norm(fc(the outputs of the target's layers target_layer_ids
  at s, concatenated)), the same c_s for every draft layer (DFlash's "KV injection");
- the block: the target's embeddings of [x_p, MASK, ..., MASK] (block_size tokens, at positions p..p+block_size-1).

Each draft layer is a pre-norm decoder layer whose queries are the block's and whose keys and values are those of
[c_0 .. c_{p-1} | the block], all visible to every block token. `norm` and the target's lm_head turn block slot i's
output into the draft of x_{p+i} (i = 1..block_size-1).

A context position's keys and values, per draft layer, depend on the prefix alone (an MLA layer's normed latent; a
Qwen3 layer's normed and rotated key and its value), so the engine keeps them in pages beside the target's: the
target's forward writes them where it writes its own latents (ContextWriter), so they follow the target's latents
through verification, prefix caching, preemption, PD handoffs and HiCache; the drafter (kestrel.engine.spec.dflash)
reads them. The output of target layer i is what a forward hook on that layer returns (as NeMo and SpecForge
capture it): with AttnRes (K3), the running sum of the current AttnRes block after layer i (KimiTextModel.run_layers).

A draft folder holds config.json (block_size and dflash_config {mask_token_id, target_layer_ids}, the layout's
shape keys) and safetensors with `layers.N.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}`, `fc`,
`hidden_norm` and `norm`; the embedding and lm_head are the target's. dflash_config's output_multiplier and
final_logit_softcapping change the logits monotonically, so drafts (their argmax) do not depend on them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .. import ops
from ..config import MLA, ModelConfig
from ..layers.batch import ForwardBatch
from ..layers.cache import HybridCache
from ..layers.linear import Linear
from ..layers.moe import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.parallel import gather_vocab
from .kimi import DecoderLayer, KimiForCausalLM

ARCHITECTURES = ("KimiK3DFlashDraftModel", "DFlashDraftModel")
MLA_SHAPE = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim")
"""config.json keys an MLA draft shares with its K3 target (NeMo builds its config from the target's)."""


def is_dflash_draft(folder: str | Path | None) -> bool:
    """Whether folder's config.json describes a published DFlash draft (either layout)."""
    path = Path(folder or "") / "config.json"
    if not path.is_file():
        return False
    raw = json.loads(path.read_text())
    return bool(set(ARCHITECTURES) & set(raw.get("architectures") or [])) or "dflash_config" in raw


@dataclass(frozen=True)
class DFlashSpec:
    """What the draft reads from the target and how wide its block is."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]


class MLADraftLayer(DecoderLayer):
    """A K3 draft layer (NeMo's KimiK3DFlashDecoderLayer): the family's MLA decoder layer with a dense MLP. Its
    context rows are the MLA latents [576]."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__(config, index, MLA, index, attn_res=False, with_indexer=False)
        self.context_width = config.kv_cache_dim

    def context_rows(self, c: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The fused context c [T, D] (at positions [T], unused: NoPE) -> the rows cached for it [T, 576]."""
        return self.self_attn.latents(c)

    def block(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
              ) -> torch.Tensor:
        """x [N, B, D] (the block, at positions [N, B]) attending to context rows [N, S, 576] and to itself (mask
        [N, B, S + B]) -> [N, B, D]."""
        x = x + self.self_attn.attend_block(self.input_layernorm(x), context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenDraftAttention(nn.Module):
    """SpecForge's DFlash attention (Qwen3's): per-head q_norm and k_norm, RoPE (rotate-half form), grouped KV heads.
    Context rows are a position's rotated keys then its values [2 * kv_heads * head_dim]."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, rope_theta: float,
                 bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rope_theta = heads, kv_heads, head_dim, rope_theta
        self.q_proj = Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE of x [..., heads, head_dim] at positions [...] (HF's rotate_half pairing), computed in fp32."""
        half = self.head_dim // 2
        inv_freq = self.rope_theta ** -(torch.arange(half, device=x.device, dtype=torch.float32) / half)
        angles = positions.float().unsqueeze(-1) * inv_freq                                # [..., half]
        cos, sin = (torch.cat([f(angles)] * 2, dim=-1).unsqueeze(-2) for f in (torch.cos, torch.sin))
        xf = x.float()
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def context_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D] at positions [T] -> [T, 2 * kv_heads * head_dim]: normed, rotated keys, then values."""
        k = self.rotate(self.k_norm(self.k_proj(x).view(-1, self.kv_heads, self.head_dim)), positions)
        return torch.cat([k.flatten(1), self.v_proj(x)], dim=-1)

    def attend_block(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
        """x [N, B, D] (normed, at positions [N, B]) attending to context rows [N, S, 2 * kv_heads * head_dim] and to
        itself, without a causal order (mask [N, B, S + B]) -> [N, B, D]."""
        n, b = x.shape[:2]
        q = self.rotate(self.q_norm(self.q_proj(x).view(n, b, self.heads, self.head_dim)), positions)
        rows = torch.cat([context.to(x.dtype), self.context_rows(x.flatten(0, 1), positions.flatten()).view(n, b, -1)],
                         dim=1)
        k, v = (part.unflatten(-1, (self.kv_heads, self.head_dim)).repeat_interleave(self.heads // self.kv_heads, 2)
                for part in rows.chunk(2, dim=-1))
        o = ops.masked_attention(q, k, v, mask, self.head_dim ** -0.5)
        return self.o_proj(o.reshape(n, b, -1))


class QwenDraftLayer(nn.Module):
    """A SpecForge DFlash draft layer: pre-norm QwenDraftAttention, then a SiLU-gated MLP."""

    def __init__(self, config: ModelConfig, attention: QwenDraftAttention):
        super().__init__()
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.mlp = GatedMLP(config, d, config.intermediate_size)
        self.context_width = 2 * attention.kv_heads * attention.head_dim

    def context_rows(self, c: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The fused context c [T, D] at positions [T] -> its rows [T, 2 * kv_heads * head_dim]."""
        return self.self_attn.context_rows(c, positions)

    def block(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
              ) -> torch.Tensor:
        """As MLADraftLayer.block, with this layout's context rows."""
        x = x + self.self_attn.attend_block(self.input_layernorm(x), context, mask, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """The draft's own weights: `layers` (all MLADraftLayer or all QwenDraftLayer), `fc`, `hidden_norm`, `norm`."""

    def __init__(self, config: ModelConfig, spec: DFlashSpec, layers: list[MLADraftLayer] | list[QwenDraftLayer]):
        super().__init__()
        self.config, self.spec = config, spec
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layers = nn.ModuleList(layers)
        self.fc = Linear(len(spec.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, eps)
        self.norm = RMSNorm(d, eps)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def context_width(self) -> int:
        """Values each layer keeps per context position."""
        return self.layers[0].context_width

    def context_rows(self, features: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """The target's layer outputs [T, L * D] at positions [T] -> each draft layer's context rows there."""
        c = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        return [layer.context_rows(c, positions) for layer in self.layers]

    def forward(self, block: torch.Tensor, contexts: list[torch.Tensor], context_mask: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """block [N, B, D]: the embeddings of [anchor, MASK, ...] at positions [N, B]; contexts: per layer, the rows
        of the N sequences' contexts [N, S, W]; context_mask [N, S] bool (False past a sequence's context) -> the
        normed outputs [N, B, D], whose logits by the target's lm_head draft the tokens after the anchor (slots
        1..)."""
        x = block.to(self.fc.weight.dtype)
        n, b = x.shape[:2]
        mask = torch.cat([context_mask, context_mask.new_ones(n, b)], dim=1).unsqueeze(1).expand(n, b, -1)
        for layer, context in zip(self.layers, contexts):
            x = layer.block(x, context, mask, positions)
        return self.norm(x)


class ContextWriter:
    """Writes the draft's context rows beside the target's latents (KimiTextModel.draft_context): at every token a
    forward over `cache` computes, each draft layer's rows of c = hidden_norm(fc(target layer outputs)) into that
    layer's pool, the last num_layers MLA pools of cache, at the rows the target's own latents go to. Forwards over
    another cache (a plain forward of a test, say) write nothing."""

    def __init__(self, draft: DFlashDraftModel, cache: HybridCache):
        self.draft, self.cache = draft, cache
        self.target_layer_ids = draft.spec.target_layer_ids
        self.pools = cache.mla[len(cache.mla) - draft.num_layers:]

    def write(self, outputs: torch.Tensor, batch: ForwardBatch) -> None:
        """outputs [T, L * D]: the target layers' outputs at batch's new tokens."""
        for pool, rows in zip(self.pools, self.draft.context_rows(outputs, batch.positions)):
            pool.latent.write(batch.kv_write_index, rows)


def draft_logits(target: KimiForCausalLM, draft: DFlashDraftModel, outputs: torch.Tensor) -> torch.Tensor:
    """The draft's outputs [..., D] -> logits [..., vocab] fp32 by the target's lm_head (not its final norm: the
    draft applies its own)."""
    flat = outputs.reshape(-1, outputs.shape[-1]).to(target.lm_head.weight.dtype)
    logits = target.lm_head(flat).float()
    return gather_vocab(logits, target.config.vocab_size, target.par.attn).view(*outputs.shape[:-1], -1)


def load_dflash_draft(folder: str | Path, target: ModelConfig, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> DFlashDraftModel:
    """The DFlash draft in folder (either layout) for the target of config `target`, in eval mode, its weights in
    dtype on device; a ValueError naming the problem if it is not one or does not fit the target."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    spec = _spec(raw, target, folder)
    num_layers = raw.get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{folder / 'config.json'}: num_hidden_layers must be the draft's depth, a positive "
                         f"integer; got {num_layers!r}.")
    if raw.get("hidden_size") != target.hidden_size:
        raise ValueError(f"the DFlash draft in {folder} was made for another target: its hidden_size is "
                         f"{raw.get('hidden_size')}, the target's {target.hidden_size}.")
    config = dataclasses.replace(
        target, architecture=(raw.get("architectures") or [ARCHITECTURES[0]])[0], num_hidden_layers=num_layers,
        layer_types=(MLA,) * num_layers, num_experts=0, num_nextn_predict_layers=0, attn_res_block_size=None,
        index_topk=0, intermediate_size=raw.get("intermediate_size", target.intermediate_size),
        rms_norm_eps=raw.get("rms_norm_eps", target.rms_norm_eps))
    if "kv_lora_rank" in raw:
        layers = _mla_layers(raw, target, config, folder)
    else:
        config = dataclasses.replace(config, hidden_act="silu")
        layers = _qwen_layers(raw, config, folder)
    model = DFlashDraftModel(config, spec, layers)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no .safetensors weights for its DFlash draft.")
    state = {name: t for f in files for name, t in load_file(str(f)).items()}
    if any(name.startswith("candidate_selector.") or "_conv." in name for name in state):
        raise ValueError(f"the draft in {folder} is a DFlash 2 draft (in-block convolutions and a path selector), "
                         "which kestrel does not run yet; it runs DFlash drafts (NeMo's KimiK3DFlashDraftModel, "
                         "SpecForge's DFlashDraftModel).")
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"the DFlash draft in {folder} does not hold the tensors its config.json describes: "
                         f"missing {missing[:4]}, unexpected {unexpected[:4]}.")
    wrong = [k for k in expected if state[k].shape != expected[k].shape]
    if wrong:
        raise ValueError(f"the DFlash draft in {folder} has {wrong[0]} of shape {tuple(state[wrong[0]].shape)}; "
                         f"its config.json describes {tuple(expected[wrong[0]].shape)}.")
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def _mla_layers(raw: dict, target: ModelConfig, config: ModelConfig, folder: Path) -> list[MLADraftLayer]:
    """NeMo's K3 layout: the target's MLA shape (checked), its activation."""
    for key in MLA_SHAPE:
        if key in raw and raw[key] != getattr(target, key):
            raise ValueError(f"the DFlash draft in {folder} was made for another target: its {key} is {raw[key]}, "
                             f"the target's {getattr(target, key)}.")
    return [MLADraftLayer(config, i) for i in range(config.num_hidden_layers)]


def _qwen_layers(raw: dict, config: ModelConfig, folder: Path) -> list[QwenDraftLayer]:
    """SpecForge's layout: Qwen3 attention of the config's heads, full attention with plain RoPE."""
    where = folder / "config.json"
    heads = raw.get("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads", heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads ({heads!r}) must be a multiple of num_key_value_heads "
                         f"({kv_heads!r}).")
    if raw.get("rope_scaling") or raw.get("hidden_act", "silu") != "silu" or any(
            kind != "full_attention" for kind in raw.get("layer_types") or []):
        raise ValueError(f"{where}: kestrel runs SpecForge DFlash drafts of full-attention layers with plain RoPE "
                         "and a SiLU MLP (no rope_scaling, sliding windows or other activations).")
    head_dim = raw.get("head_dim") or config.hidden_size // heads
    return [QwenDraftLayer(config, QwenDraftAttention(config.hidden_size, heads, kv_heads, head_dim,
                                                      config.rms_norm_eps, float(raw.get("rope_theta", 10000.0)),
                                                      bool(raw.get("attention_bias", False))))
            for _ in range(config.num_hidden_layers)]


def _spec(raw: dict, target: ModelConfig, folder: Path) -> DFlashSpec:
    """The block size, mask token and target layers of config.json `raw`, checked against the target."""
    dflash = raw.get("dflash_config") or {}
    block_size, mask = raw.get("block_size", dflash.get("block_size")), dflash.get("mask_token_id")
    layers = dflash.get("target_layer_ids")
    if layers is None and isinstance(raw.get("num_target_layers"), int):        # NeMo's default choice
        layers = default_target_layers(raw["num_target_layers"], raw.get("num_hidden_layers", 0))
    where = folder / "config.json"
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"{where}: block_size must be an integer of at least 2, got {block_size!r}.")
    if not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        raise ValueError(f"{where}: dflash_config.mask_token_id must be a token id below {target.vocab_size}, got "
                         f"{mask!r}.")
    if (not isinstance(layers, list) or not layers
            or not all(isinstance(i, int) and 0 <= i < target.num_hidden_layers for i in layers)):
        raise ValueError(f"{where}: dflash_config.target_layer_ids must list layers of the target (0 to "
                         f"{target.num_hidden_layers - 1}), got {layers!r}.")
    return DFlashSpec(block_size, mask, tuple(layers))


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a DFlash draft reads when its config names none: the middle one for one draft layer, else
    num_draft_layers spread evenly from layer 1 to layer num_target_layers - 3 (DFlash's rule)."""
    if num_draft_layers <= 1:
        return [num_target_layers // 2]
    last = num_target_layers - 3
    return [round(1 + i * (last - 1) / (num_draft_layers - 1)) for i in range(num_draft_layers)]
