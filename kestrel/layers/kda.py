"""Kimi Delta Attention (KDA): gated delta-rule linear attention with short convolutions (model-spec section 4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..config import ModelConfig
from .batch import ForwardBatch
from .cache import HybridCache
from .norm import GatedRMSNorm


def kda_decay_gate(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   lower_bound: float | None) -> torch.Tensor:
    """Per-channel log decay g <= 0 from the gate projection, in fp32.

    raw: [T, H, K]; A_log: [H]; dt_bias: [H*K]. Kimi-Linear (lower_bound None): g = -exp(A_log) softplus(raw + dt).
    K3 family: g = lower_bound * sigmoid(exp(A_log) (raw + dt)), so g lies in (lower_bound, 0).
    """
    num_heads, head_dim = raw.shape[-2:]
    x = raw.float() + dt_bias.float().view(num_heads, head_dim)
    rate = A_log.float().exp().unsqueeze(-1)
    if lower_bound is None:
        return -rate * F.softplus(x)
    return lower_bound * torch.sigmoid(rate * x)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32 (fla's l2norm)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class KimiDeltaAttention(nn.Module):
    """One KDA layer. Parameter names follow the checkpoints (`self_attn.*`); A_log is held as [H].

    kda_index: the layer's position among the model's KDA layers (its state pool in a HybridCache).
    """

    def __init__(self, config: ModelConfig, kda_index: int):
        super().__init__()
        self.kda_index = kda_index
        self.num_heads, self.head_dim = config.kda_num_heads, config.kda_head_dim
        self.lower_bound = config.kda_gate_lower_bound
        width = self.num_heads * self.head_dim
        hidden, kernel = config.hidden_size, config.conv_kernel_size
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(self, name, nn.Conv1d(width, width, kernel, groups=width, bias=False, dtype=torch.float32))
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        if config.kda_full_rank_output_gate:
            self.g_proj = nn.Linear(hidden, width, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.o_norm = GatedRMSNorm(self.head_dim, config.rms_norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache | None = None) -> torch.Tensor:
        """x: [T, hidden] (after input_layernorm) -> [T, hidden]. Reads and writes the sequences' state slots."""
        num_tokens = x.shape[0]
        state = cache.kda[self.kda_index] if cache is not None else None
        conv_state, recurrent_state = self._initial_states(state, batch)

        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        conv_weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]
        qkv, conv_final = ops.causal_conv1d(qkv, conv_weight, batch.cu_seqlens, conv_state)
        q, k, v = F.silu(qkv).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = l2_normalize(q), l2_normalize(k)
        g = kda_decay_gate(self.f_b_proj(self.f_a_proj(x)).view_as(q), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())

        kda = ops.recurrent_kda if batch.max_new <= 1 else ops.chunk_kda
        o, final_state, _ = kda(q, k, v, g, beta, batch.cu_seqlens, initial_state=recurrent_state)
        if state is not None:
            state.conv[batch.state_slots] = conv_final.detach().to(state.conv.dtype)
            state.recurrent[batch.state_slots] = final_state.detach().to(state.recurrent.dtype)

        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o, gate.view_as(o)).reshape(num_tokens, -1)
        return self.o_proj(o)

    def _initial_states(self, state, batch: ForwardBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The sequences' conv and recurrent states; zero for a sequence with no prefix, whatever its slot holds."""
        if state is None:
            if batch.has_prefix:
                raise ValueError("a batch with cached prefixes needs the cache that holds them.")
            return None, None
        keep = (batch.prefix_lens > 0).view(-1, 1, 1)
        conv = torch.where(keep, state.conv[batch.state_slots], 0)
        recurrent = torch.where(keep.unsqueeze(-1), state.recurrent[batch.state_slots].float(), 0)
        return conv, recurrent
