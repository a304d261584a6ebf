"""Published DFlash and DSpark drafts for the Kimi family: a few dense layers that propose a block of tokens in one
non-causal forward, their keys and values spanning the target's context as well as the block. These load:

- NVIDIA NeMo AutoModel's `KimiK3DFlashDraftModel` (K3 targets): K3 MLA layers (NoPE, Q-LoRA, output gate) and a
  SiTU MLP, under the K3 checkpoint's names; config.json is the target's text config with num_hidden_layers the
  draft's depth (it has kv_lora_rank);
- SpecForge's `DFlashDraftModel` (z-lab's DFlash, NeMo's Qwen3 draft; any target): Qwen3 attention (q_proj, k_proj,
  v_proj, o_proj, per-head q_norm and k_norm, grouped KV heads, RoPE, plain or YaRN) and a SiLU MLP;
- NeMo's DSpark drafts, `KimiK3DSparkModel` and `Qwen3DSparkModel`: the layers of the first or second layout, their
  own embed_tokens and lm_head, every block slot drafting the token after it, and a Markov head (MarkovHead) that
  makes each draft depend on the one before it; the confidence head, which schedules how many drafts SGLang
  verifies, is not loaded (kestrel verifies every draft asked for).

For a sequence whose positions 0..p-1 the target has computed and whose token x_p is known (the anchor):

- the context: at every position s < p, c_s = hidden_norm(fc(the outputs of the target's layers target_layer_ids
  at s, concatenated)), the same c_s for every draft layer (DFlash's "KV injection");
- the block: the embeddings of [x_p, MASK, ..., MASK] (block_size tokens, at positions p..p+block_size-1).

Each draft layer is a pre-norm decoder layer whose queries are the block's and whose keys and values are those of
[c_0 .. c_{p-1} | the block], all visible to every block token. `norm` and the lm_head turn block slot i's output
into the draft of x_{p+i} (DFlash: i = 1..block_size-1) or of x_{p+1+i} (DSpark: i = 0..block_size-1). The embedding
and lm_head are the target's unless the draft holds its own (DSpark).

A context position's keys and values, per draft layer, depend on the prefix alone (an MLA layer's normed latent; a
Qwen3 layer's normed and rotated key and its value), so the engine keeps them in pages beside the target's: the
target's forward writes them where it writes its own latents (ContextWriter), so they follow the target's latents
through verification, prefix caching, preemption, PD handoffs and HiCache; the drafter
(kestrel.engine.speculative.dflash) reads them. The output of target layer i is what a forward hook on that layer
returns (as NeMo and SpecForge capture it): with AttnRes (K3), the running sum of the current AttnRes block after
layer i (KimiTextModel.run_layers); as in HuggingFace's output_hidden_states, layer -1 is the embedding and the last
layer's output is taken after the final norm.

A draft folder holds config.json (block_size and dflash_config {mask_token_id, target_layer_ids}, or DSpark's
top-level block_size, mask_token_id, target_layer_ids, markov_rank and markov_head_type; the layout's shape keys)
and safetensors with `layers.N.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}`, `fc`,
`hidden_norm` and `norm` (DSpark: also `embed_tokens`, `lm_head`, `markov_head.*`, `confidence_head.*`).
dflash_config's output_multiplier and final_logit_softcapping change the logits monotonically, so drafts (their
argmax) do not depend on them.
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
from ..layers.rope import Rope, rope_from_config
from .kimi import DecoderLayer, KimiForCausalLM

DSPARK = ("KimiK3DSparkModel", "Qwen3DSparkModel")
ARCHITECTURES = ("KimiK3DFlashDraftModel", "DFlashDraftModel", *DSPARK)
MARKOV_KINDS = ("vanilla", "gated", "rnn")
MLA_SHAPE = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim")
"""config.json keys an MLA draft shares with its K3 target (NeMo builds its config from the target's)."""


def is_dflash_draft(folder: str | Path | None) -> bool:
    """Whether folder's config.json describes a published DFlash or DSpark draft (any layout: load_dflash_draft
    refuses the ones kestrel does not run)."""
    raw = _config(folder)
    return raw is not None and (bool(set(ARCHITECTURES) & set(raw.get("architectures") or []))
                                or "dflash_config" in raw or bool(_dspark_architectures(raw)))


def is_dspark_draft(folder: str | Path | None) -> bool:
    """Whether folder's config.json describes a DSpark draft (any layout)."""
    raw = _config(folder)
    return raw is not None and bool(_dspark_architectures(raw))


def _config(folder: str | Path | None) -> dict | None:
    """folder's config.json, None if it has none."""
    path = Path(folder or "") / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _dspark_architectures(raw: dict) -> list[str]:
    """The DSpark architectures config.json `raw` names (NeMo's names end in DSparkModel)."""
    return [str(a) for a in raw.get("architectures") or [] if str(a).endswith("DSparkModel")]


@dataclass(frozen=True)
class DFlashSpec:
    """What the draft reads from the target and how wide its block is."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]      # -1: the embedding; the target's last layer: its output after the norm
    first_slot: int = 1                    # the block slot that drafts x_{p+1}: DFlash 1 (slot 0 is the anchor's),
                                           # DSpark 0 (each slot drafts the token after its position)

    @property
    def drafts(self) -> int:
        """Draft tokens per block."""
        return self.block_size - self.first_slot


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
    """SpecForge's DFlash attention (Qwen3's): per-head q_norm and k_norm, RoPE (rotate-half form, plain or YaRN),
    grouped KV heads. Context rows are a position's rotated keys then its values [2 * kv_heads * head_dim]."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, rope: Rope, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rope = heads, kv_heads, head_dim, rope
        self.q_proj = Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def context_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D] at positions [T] -> [T, 2 * kv_heads * head_dim]: normed, rotated keys, then values."""
        k = self.rope.rotate(self.k_norm(self.k_proj(x).view(-1, self.kv_heads, self.head_dim)), positions)
        return torch.cat([k.flatten(1), self.v_proj(x)], dim=-1)

    def attend_block(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
        """x [N, B, D] (normed, at positions [N, B]) attending to context rows [N, S, 2 * kv_heads * head_dim] and to
        itself, without a causal order (mask [N, B, S + B]) -> [N, B, D]."""
        n, b = x.shape[:2]
        q = self.rope.rotate(self.q_norm(self.q_proj(x).view(n, b, self.heads, self.head_dim)), positions)
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


class MarkovHead(nn.Module):
    """DSpark's serial head (NeMo's markov_head.py): the logits of a block slot gain a bias from the token before it
    (the anchor for the first draft, else the draft before), so the drafts of one block depend on each other.

    With e = markov_w1[previous token] [r] and h the slot's normed output [D]: vanilla, bias = markov_w2 e; gated,
    markov_w2 (sigmoid(gate_proj [h, e]) * e); rnn, a GRU-like state s [r], zero before the first draft:
    [g, c, o] = joint_proj [s, e, h], s <- sigmoid(g) s + (1 - sigmoid(g)) tanh(c), bias = markov_w2 tanh(o).
    """

    def __init__(self, kind: str, vocab: int, rank: int, hidden: int):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = Linear(2 * rank + hidden, 3 * rank)

    def drafts(self, logits: torch.Tensor, outputs: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """logits [N, S, V] fp32 (the slots' own), outputs [N, S, D] (their normed outputs), anchors [N] (the token
        before the first slot's) -> drafts [N, S] int64, each the argmax of its slot's logits plus the bias from the
        draft before it."""
        previous, state, drafts = anchors, None, []
        for k in range(logits.shape[1]):
            bias, state = self._bias(previous, outputs[:, k], state)
            previous = (logits[:, k] + bias.float()).argmax(-1)
            drafts.append(previous)
        return torch.stack(drafts, 1)

    def _bias(self, previous: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """previous [N] ids, h [N, D], state [N, r] or None -> (the bias [N, V], the rnn's next state)."""
        e = self.markov_w1(previous).to(h.dtype)
        if self.kind == "gated":
            e = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e
        elif self.kind == "rnn":
            state = torch.zeros_like(e) if state is None else state
            gate, candidate, out = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1 - gate) * torch.tanh(candidate)
            e = torch.tanh(out)
        return self.markov_w2(e), state


class DFlashDraftModel(nn.Module):
    """The draft's own weights: `layers` (all MLADraftLayer or all QwenDraftLayer), `fc`, `hidden_norm`, `norm`; a
    DSpark draft's also `embed_tokens`, `lm_head` (own_head) and its `markov_head` (if its markov_rank is not 0)."""

    def __init__(self, config: ModelConfig, spec: DFlashSpec, layers: list[MLADraftLayer] | list[QwenDraftLayer],
                 own_head: bool = False, markov_head: MarkovHead | None = None):
        super().__init__()
        self.config, self.spec = config, spec
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layers = nn.ModuleList(layers)
        self.fc = Linear(len(spec.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, eps)
        self.norm = RMSNorm(d, eps)
        self.embed_tokens = nn.Embedding(config.vocab_size, d) if own_head else None
        self.lm_head = Linear(d, config.vocab_size, bias=False) if own_head else None
        self.markov_head = markov_head

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
        normed outputs [N, B, D], whose logits (draft_logits) draft the tokens after the anchor (from slot
        spec.first_slot on)."""
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


def embed(target: KimiForCausalLM, draft: DFlashDraftModel, ids: torch.Tensor) -> torch.Tensor:
    """The block's embeddings [..., D] of ids [...]: by the draft's own table if it has one, else the target's."""
    return (target.model.embed_tokens if draft.embed_tokens is None else draft.embed_tokens)(ids)


def draft_logits(target: KimiForCausalLM, draft: DFlashDraftModel, outputs: torch.Tensor) -> torch.Tensor:
    """The draft's outputs [..., D] -> logits [..., vocab] fp32 by its own lm_head if it has one, else the target's
    (not the target's final norm: the draft applies its own)."""
    if draft.lm_head is not None:
        return draft.lm_head(outputs).float()
    flat = outputs.reshape(-1, outputs.shape[-1]).to(target.lm_head.weight.dtype)
    logits = target.lm_head(flat).float()
    return gather_vocab(logits, target.config.vocab_size, target.par.attn).view(*outputs.shape[:-1], -1)


def draft_tokens(target: KimiForCausalLM, draft: DFlashDraftModel, outputs: torch.Tensor, anchors: torch.Tensor
                 ) -> torch.Tensor:
    """The drafts [N, S] int64 of the drafting slots' outputs [N, S, D] of blocks after anchors [N]: each slot's
    argmax, through the Markov head when the draft has one."""
    logits = draft_logits(target, draft, outputs)
    if draft.markov_head is None:
        return logits.argmax(-1)
    return draft.markov_head.drafts(logits, outputs, anchors)


def load_dflash_draft(folder: str | Path, target: ModelConfig, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> DFlashDraftModel:
    """The DFlash or DSpark draft in folder (any layout) for the target of config `target`, in eval mode, its weights
    in dtype on device; a ValueError naming the problem if it is not one or does not fit the target."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    named = _dspark_architectures(raw)
    dspark = bool(named)
    if dspark and not set(DSPARK) & set(named):
        raise ValueError(f"the draft in {folder} is a {named[0]}; kestrel runs DSpark drafts of the layouts "
                         f"{' and '.join(DSPARK)}.")
    spec = _spec(raw, target, folder, dspark)
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
    markov = _markov_head(raw, config, folder) if dspark else None
    model = DFlashDraftModel(config, spec, layers, own_head=dspark, markov_head=markov)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no .safetensors weights for its DFlash draft.")
    state = {name: t for f in files for name, t in load_file(str(f)).items()
             if not (dspark and name.startswith("confidence_head."))}       # it only schedules verification
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
    """SpecForge's layout: Qwen3 attention of the config's heads, full attention with plain or YaRN RoPE."""
    where = folder / "config.json"
    heads = raw.get("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads", heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads ({heads!r}) must be a multiple of num_key_value_heads "
                         f"({kv_heads!r}).")
    if raw.get("hidden_act", "silu") != "silu" or any(kind != "full_attention"
                                                      for kind in raw.get("layer_types") or []):
        raise ValueError(f"{where}: kestrel runs SpecForge DFlash drafts of full-attention layers and a SiLU MLP (no "
                         "sliding windows or other activations).")
    head_dim = raw.get("head_dim") or config.hidden_size // heads
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}       # transformers 4's or 5's key
    try:
        rope = rope_from_config(head_dim, float(raw.get("rope_theta") or scaling.get("rope_theta") or 10000.0),
                                scaling)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: its RoPE does not load: {e}") from e
    bias = bool(raw.get("attention_bias", False))
    return [QwenDraftLayer(config, QwenDraftAttention(config.hidden_size, heads, kv_heads, head_dim,
                                                      config.rms_norm_eps, rope, bias))
            for _ in range(config.num_hidden_layers)]


def _spec(raw: dict, target: ModelConfig, folder: Path, dspark: bool) -> DFlashSpec:
    """The block size, mask token and target layers of config.json `raw` (DFlash's dflash_config, or DSpark's top
    level), checked against the target."""
    dflash = raw if dspark else raw.get("dflash_config") or {}
    block_size, mask = raw.get("block_size", dflash.get("block_size")), dflash.get("mask_token_id")
    layers = dflash.get("target_layer_ids")
    if layers is None and isinstance(raw.get("num_target_layers"), int):        # NeMo's default choice
        layers = default_target_layers(raw["num_target_layers"], raw.get("num_hidden_layers", 0))
    where, first_slot = folder / "config.json", 0 if dspark else 1
    if not isinstance(block_size, int) or block_size < first_slot + 1:
        raise ValueError(f"{where}: block_size must be an integer of at least {first_slot + 1}, got {block_size!r}.")
    if not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        raise ValueError(f"{where}: mask_token_id must be a token id below {target.vocab_size}, got {mask!r}.")
    if (not isinstance(layers, list) or not layers
            or not all(isinstance(i, int) and -1 <= i < target.num_hidden_layers for i in layers)):
        raise ValueError(f"{where}: target_layer_ids must list layers of the target (-1, the embedding, to "
                         f"{target.num_hidden_layers - 1}), got {layers!r}.")
    return DFlashSpec(block_size, mask, tuple(layers), first_slot)


def _markov_head(raw: dict, config: ModelConfig, folder: Path) -> MarkovHead | None:
    """A DSpark draft's Markov head as its config.json describes it; None for markov_rank 0."""
    rank, kind = raw.get("markov_rank", 0), raw.get("markov_head_type", "vanilla")
    if not isinstance(rank, int) or rank < 0 or kind not in MARKOV_KINDS:
        raise ValueError(f"{folder / 'config.json'}: markov_rank must be a non-negative integer and markov_head_type "
                         f"one of {', '.join(MARKOV_KINDS)}; got {rank!r} and {kind!r}.")
    return MarkovHead(kind, config.vocab_size, rank, config.hidden_size) if rank else None


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a DFlash draft reads when its config names none: the middle one for one draft layer, else
    num_draft_layers spread evenly from layer 1 to layer num_target_layers - 3 (DFlash's rule)."""
    if num_draft_layers <= 1:
        return [num_target_layers // 2]
    last = num_target_layers - 3
    return [round(1 + i * (last - 1) / (num_draft_layers - 1)) for i in range(num_draft_layers)]
