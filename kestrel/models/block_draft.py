"""A DFlash-style block draft: a few small transformer layers that propose a block of tokens in one forward,
conditioned on the target model's hidden state.

For a sequence whose last computed position is t (hidden state h_t, the target's pre-final-norm output) and whose
next token x_{t+1} is known, the draft reads block_size + 2 slots,

    [proj(norm(h_t)), embed(x_{t+1}), mask, ..., mask] + slot embeddings,

runs its layers with full (bidirectional) attention among the slots, and mask slot i's output, through the
target's final norm and lm_head, predicts token x_{t+1+i} (i = 1..block_size). The token embedding, final norm
and lm_head are the target's (frozen, not stored here), so the draft's folder holds only its own layers:
config.json (BlockDraftConfig) and model.safetensors.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from .kimi import KimiForCausalLM

MODEL_TYPE = "kestrel_block_draft"
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class BlockDraftConfig:
    """The draft's shape. hidden_size must be the target's (it shares the target's embedding and lm_head)."""

    hidden_size: int
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 512
    block_size: int = 8
    rms_norm_eps: float = 1e-5
    target: str = ""                    # the target model it was trained for (informational)

    def to_json(self) -> dict:
        return {"model_type": MODEL_TYPE, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> BlockDraftConfig:
        if data.get("model_type") != MODEL_TYPE:
            raise ValueError(f"config.json has model_type {data.get('model_type')!r}, not a kestrel block draft "
                             f"({MODEL_TYPE!r}).")
        return cls(**{k: v for k, v in data.items() if k != "model_type"})


class DraftLayer(nn.Module):
    """Pre-norm block over the slots: bidirectional multi-head attention, then a SwiGLU MLP."""

    def __init__(self, config: BlockDraftConfig):
        super().__init__()
        d, self.heads = config.hidden_size, config.num_heads
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.qkv_proj = Linear(d, 3 * d, bias=False)
        self.o_proj = Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d, config.rms_norm_eps)
        self.gate_up_proj = Linear(d, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, S, D] -> [N, S, D]."""
        n, s, d = x.shape
        q, k, v = self.qkv_proj(self.attn_norm(x)).view(n, s, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.o_proj(attn.transpose(1, 2).reshape(n, s, d))
        gate, up = self.gate_up_proj(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class BlockDraftModel(nn.Module):
    """The draft's own weights: conditioning projection, mask and slot embeddings, layers."""

    def __init__(self, config: BlockDraftConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.cond_norm = RMSNorm(d, config.rms_norm_eps)
        self.cond_proj = Linear(d, d, bias=False)
        self.mask_embed = nn.Parameter(torch.zeros(d))
        self.slot_embed = nn.Parameter(torch.zeros(config.block_size + 2, d))
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_layers))

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] (the target's at position t), next_embeds [N, D] (the target's embedding of token t+1)
        -> [N, block_size, D]: the outputs whose target logits predict tokens t+2 .. t+1+block_size."""
        n, k = hidden.shape[0], self.config.block_size
        x = torch.cat([self.cond_proj(self.cond_norm(hidden)).unsqueeze(1), next_embeds.unsqueeze(1),
                       self.mask_embed.expand(n, k, -1)], dim=1) + self.slot_embed
        for layer in self.layers:
            x = layer(x)
        return x[:, 2:]

    def init_weights(self, seed: int) -> BlockDraftModel:
        """Seeded initialisation: normal(0, 0.02) matrices and embeddings, output projections scaled down by the
        depth, unit norms."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    std = 0.02 / (2 * self.config.num_layers) ** 0.5 if name.endswith(("o_proj.weight",
                                                                                       "down_proj.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self


def block_outputs(target: KimiForCausalLM, draft: BlockDraftModel, hidden: torch.Tensor, next_ids: torch.Tensor,
                  num_slots: int | None = None) -> torch.Tensor:
    """The draft's outputs [N, S, D] for tokens t+2 .. t+1+S (S = num_slots, default block_size), in the dtype of
    the target's lm_head, from the target's hidden states at t [N, D] and the ids of tokens t+1 [N] (through the
    target's embedding); the target's final norm and lm_head turn them into logits."""
    dtype = draft.cond_proj.weight.dtype
    out = draft(hidden.to(dtype), target.model.embed_tokens(next_ids).to(dtype))[:, :num_slots]
    return out.to(target.lm_head.weight.dtype)


def block_logits(target: KimiForCausalLM, draft: BlockDraftModel, hidden: torch.Tensor,
                 next_ids: torch.Tensor, num_slots: int | None = None) -> torch.Tensor:
    """The draft's logits [N, S, vocab] fp32: block_outputs through the target's final norm and lm_head (only the
    S slots asked for reach the lm_head)."""
    out = block_outputs(target, draft, hidden, next_ids, num_slots)
    n, k, d = out.shape
    return target.compute_logits(out.reshape(n * k, d)).view(n, k, -1)


def save_block_draft(model: BlockDraftModel, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write folder/config.json and folder/model.safetensors (weights in dtype)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    save_file({k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}, str(folder / WEIGHTS))


def load_block_draft(folder: str | Path, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> BlockDraftModel:
    """The draft saved in folder, in eval mode, its weights cast to dtype on device."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / WEIGHTS).is_file():
        raise ValueError(f"{folder} is not a block draft folder (it needs config.json and {WEIGHTS}).")
    model = BlockDraftModel(BlockDraftConfig.from_json(json.loads((folder / "config.json").read_text())))
    state = load_file(str(folder / WEIGHTS))
    expected = model.state_dict()
    if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
        raise ValueError(f"{folder / WEIGHTS} does not hold the tensors its config.json describes.")
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()
