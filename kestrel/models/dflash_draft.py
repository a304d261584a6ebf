"""Published Kimi K3 DFlash drafts (the layout of NVIDIA NeMo AutoModel's `KimiK3DFlashDraftModel`): a few dense K3
MLA layers that propose a block of tokens in one non-causal forward, their keys and values spanning the target's
context as well as the block.

For a sequence whose positions 0..p-1 the target has computed and whose token x_p is known (the anchor):

- the context: at every position s < p, c_s = hidden_norm(fc(the outputs of the target's layers target_layer_ids
  at s, concatenated)), the same c_s for every draft layer (DFlash's "KV injection");
- the block: the target's embeddings of [x_p, MASK, ..., MASK] (block_size tokens).

Each draft layer is a pre-norm K3 decoder layer (NoPE MLA with Q-LoRA and output gate, dense SiTU MLP) whose queries
are the block's and whose keys and values are those of [c_0 .. c_{p-1} | the block], all visible to every block
token. `norm` and the target's lm_head turn block slot i's output into the draft of x_{p+i} (i = 1..block_size-1).

A K3 MLA layer's keys and values come from a latent of its input (kv_a_proj_with_mqa, normed: what kestrel's pages
hold), so a context position's latent for each draft layer depends on the prefix alone, and the engine keeps it in
pages beside the target's: the target's forward writes them where it writes its own (ContextWriter), so they follow
the target's latents through verification, prefix caching, preemption, PD handoffs and HiCache; the drafter
(kestrel.engine.spec.dflash) reads them. With AttnRes (K3) the output of target layer i is what a forward hook on
that layer returns in NeMo's model: the running sum of the current AttnRes block after layer i
(KimiTextModel.run_layers).

A draft folder holds config.json (the target's K3 text config with num_hidden_layers the draft's depth, and
block_size and dflash_config {mask_token_id, target_layer_ids}) and safetensors with `layers.N.{input_layernorm,
self_attn.*, post_attention_layernorm, mlp.*}`, `fc`, `hidden_norm` and `norm`; the embedding and lm_head are the
target's. dflash_config's output_multiplier and final_logit_softcapping change the logits monotonically, so drafts
(their argmax) do not depend on them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..config import MLA, ModelConfig
from ..layers.batch import ForwardBatch
from ..layers.cache import HybridCache
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.parallel import gather_vocab
from .kimi import DecoderLayer, KimiForCausalLM

ARCHITECTURE = "KimiK3DFlashDraftModel"
SHARED_SHAPE = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim")
"""config.json keys a draft shares with its target (it reads the target's hidden states, embedding and lm_head)."""


def is_dflash_draft(folder: str | Path) -> bool:
    """Whether folder's config.json describes a K3 DFlash draft."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    raw = json.loads(path.read_text())
    return ARCHITECTURE in (raw.get("architectures") or []) or "dflash_config" in raw


@dataclass(frozen=True)
class DFlashSpec:
    """What the draft reads from the target and how wide its block is."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]


class DFlashDraftModel(nn.Module):
    """The draft's own weights: `layers` (K3 decoder layers, MLA and a dense MLP), `fc`, `hidden_norm`, `norm`."""

    def __init__(self, config: ModelConfig, spec: DFlashSpec):
        super().__init__()
        self.config, self.spec = config, spec
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layers = nn.ModuleList(DecoderLayer(config, i, MLA, i, attn_res=False, with_indexer=False)
                                    for i in range(config.num_hidden_layers))
        self.fc = Linear(len(spec.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, eps)
        self.norm = RMSNorm(d, eps)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def context_latents(self, features: torch.Tensor) -> list[torch.Tensor]:
        """The target's layer outputs at some positions [T, L * D] -> each draft layer's latents there [T, 576]."""
        c = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        return [layer.self_attn.latents(c) for layer in self.layers]

    def forward(self, block: torch.Tensor, contexts: list[torch.Tensor], context_mask: torch.Tensor) -> torch.Tensor:
        """block [N, B, D]: the embeddings of [anchor, MASK, ...]; contexts: per layer, the latents of the N
        sequences' contexts [N, S, 576]; context_mask [N, S] bool (False past a sequence's context) -> the normed
        outputs [N, B, D], whose logits by the target's lm_head draft the tokens after the anchor (slots 1..)."""
        x = block.to(self.fc.weight.dtype)
        for layer, context in zip(self.layers, contexts):
            x = x + layer.self_attn.attend_block(layer.input_layernorm(x), context, context_mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


class ContextWriter:
    """Writes the draft's context latents beside the target's (KimiTextModel.draft_context): at every token a
    forward over `cache` computes, each draft layer's latent of c = hidden_norm(fc(target layer outputs)) into that
    layer's pool, the last num_layers MLA pools of cache, at the rows the target's own latents go to. Forwards over
    another cache (a plain forward of a test, say) write nothing."""

    def __init__(self, draft: DFlashDraftModel, cache: HybridCache):
        self.draft, self.cache = draft, cache
        self.target_layer_ids = draft.spec.target_layer_ids
        self.pools = cache.mla[len(cache.mla) - draft.num_layers:]

    def write(self, outputs: torch.Tensor, batch: ForwardBatch) -> None:
        """outputs [T, L * D]: the target layers' outputs at batch's new tokens."""
        for pool, latents in zip(self.pools, self.draft.context_latents(outputs)):
            pool.latent.write(batch.kv_write_index, latents)


def draft_logits(target: KimiForCausalLM, draft: DFlashDraftModel, outputs: torch.Tensor) -> torch.Tensor:
    """The draft's outputs [..., D] -> logits [..., vocab] fp32 by the target's lm_head (not its final norm: the
    draft applies its own)."""
    flat = outputs.reshape(-1, outputs.shape[-1]).to(target.lm_head.weight.dtype)
    logits = target.lm_head(flat).float()
    return gather_vocab(logits, target.config.vocab_size, target.par.attn).view(*outputs.shape[:-1], -1)


def load_dflash_draft(folder: str | Path, target: ModelConfig, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> DFlashDraftModel:
    """The K3 DFlash draft in folder for the target of config `target`, in eval mode, its weights in dtype on
    device; a ValueError naming the problem if it is not one or was made for a target of another shape."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    for key in SHARED_SHAPE:
        if key in raw and raw[key] != getattr(target, key):
            raise ValueError(f"the DFlash draft in {folder} was made for another target: its {key} is {raw[key]}, "
                             f"the target's {getattr(target, key)}.")
    spec = _spec(raw, target, folder)
    num_layers = raw.get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{folder / 'config.json'}: num_hidden_layers must be the draft's depth, a positive "
                         f"integer; got {num_layers!r}.")
    config = dataclasses.replace(
        target, architecture=ARCHITECTURE, num_hidden_layers=num_layers, layer_types=(MLA,) * num_layers,
        num_experts=0, num_nextn_predict_layers=0, attn_res_block_size=None, index_topk=0,
        intermediate_size=raw.get("intermediate_size", target.intermediate_size),
        rms_norm_eps=raw.get("rms_norm_eps", target.rms_norm_eps))
    model = DFlashDraftModel(config, spec)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no .safetensors weights for its DFlash draft.")
    state = {name: t for f in files for name, t in load_file(str(f)).items()}
    if any(name.startswith("candidate_selector.") or "_conv." in name for name in state):
        raise ValueError(f"the draft in {folder} is a DFlash 2 draft (in-block convolutions and a path selector), "
                         "which kestrel does not run yet; it runs DFlash drafts (NeMo's KimiK3DFlashDraftModel).")
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
