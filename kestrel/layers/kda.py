"""Kimi Delta Attention (KDA): gated delta-rule linear attention with short convolutions (model-spec section 4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..ops import backend
from ..ops.torch.kda_decode import KDALayerParams, decay_gate, gated_rms_norm, l2_normalize
from ..distributed.parallel import SINGLE, Parallel
from .batch import ForwardBatch
from .cache import HybridCache
from .linear import Linear, LinearGroup
from .norm import RMSNorm
from .parallel import RowParallelLinear


class KimiDeltaAttention(nn.Module):
    """One KDA layer. Parameter names follow the checkpoints (`self_attn.*`); A_log is held as [H].

    kda_index: the layer's position among the model's KDA layers (its state pool in a HybridCache).
    Under tensor parallelism each rank runs num_heads = H / tp heads (their projections, convs, gates and state);
    o_proj is row-parallel. token_wise (deterministic inference sets it): every cached forward, prefill chunks too,
    runs the decode op's token-by-token recurrence, so a token's numbers never depend on how it was chunked.
    """

    def __init__(self, config: ModelConfig, kda_index: int, par: Parallel = SINGLE):
        super().__init__()
        self.kda_index = kda_index
        self.num_heads, self.head_dim = config.kda_num_heads // par.tp_size, config.kda_head_dim
        self.lower_bound = config.kda_gate_lower_bound
        width = config.kda_num_heads * self.head_dim
        hidden, kernel = config.hidden_size, config.conv_kernel_size
        self.q_proj = Linear(hidden, width, bias=False)
        self.k_proj = Linear(hidden, width, bias=False)
        self.v_proj = Linear(hidden, width, bias=False)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(self, name, nn.Conv1d(width, width, kernel, groups=width, bias=False, dtype=torch.float32))
        self.f_a_proj = Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = Linear(self.head_dim, width, bias=False)
        self.b_proj = Linear(hidden, config.kda_num_heads, bias=False)
        if config.kda_full_rank_output_gate:
            self.g_proj = Linear(hidden, width, bias=False)
        else:
            self.g_a_proj = Linear(hidden, self.head_dim, bias=False)
            self.g_b_proj = Linear(self.head_dim, width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(config.kda_num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.o_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=torch.float32)   # gated by g_proj
        self.o_proj = RowParallelLinear(width, hidden, par)
        self.in_proj = LinearGroup(self.q_proj, self.k_proj, self.v_proj, self.f_a_proj,
                                   self.g_proj if config.kda_full_rank_output_gate else self.g_a_proj, self.b_proj)
        self.token_wise = False

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache | None = None) -> torch.Tensor:
        """x: [T, hidden] (after input_layernorm) -> [T, hidden]. Reads and writes the sequences' state slots.

        Decode steps (one token per sequence, with a cache) run as one fused op over the state pool; prefill
        chunks run the short conv and chunked KDA (from the slots' states with a cache, from zeros without). A
        speculative verification (batch.keep_token_states) runs the decode op over its few tokens per sequence,
        leaving the pool as it was and the state after every token in the cache's token_states.
        """
        num_tokens = x.shape[0]
        state = cache.kda[self.kda_index] if cache is not None else None
        q, k, v, gate_low_rank, out_gate, beta_raw = self.in_proj(x)
        qkv = torch.cat([q, k, v], dim=-1)
        gate_raw = self.f_b_proj(gate_low_rank).view(num_tokens, self.num_heads, self.head_dim)
        out_gate = (out_gate if hasattr(self, "g_proj") else self.g_b_proj(out_gate)).view_as(gate_raw)
        if state is not None and (batch.max_new <= 1 or batch.keep_token_states or self.token_wise):
            o = self._by_tokens(qkv, gate_raw, beta_raw, out_gate, batch, state)
        else:
            o = self._prefill(qkv, gate_raw, beta_raw, batch, state)
            o = gated_rms_norm(o, out_gate, self.o_norm.weight, self.o_norm.eps)
        return self.o_proj(o.reshape(num_tokens, -1))

    def _by_tokens(self, qkv: torch.Tensor, gate_raw: torch.Tensor, beta_raw: torch.Tensor, out_gate: torch.Tensor,
                   batch: ForwardBatch, state) -> torch.Tensor:
        """The decode op over the new tokens (after the output norm), token by token from the slots' states; with
        captures (token_wise prefill chunks), over the rows before them, then, the captured states copied to their
        slots, over the rest."""
        decode = backend.get_op("kda_decode", qkv.device)

        def run(rows: torch.Tensor | None, cu_seqlens: torch.Tensor | None, slots: torch.Tensor,
                use_state: torch.Tensor) -> torch.Tensor:
            inputs = (qkv, gate_raw, beta_raw, out_gate) if rows is None else (qkv[rows], gate_raw[rows],
                                                                                beta_raw[rows], out_gate[rows])
            o, state.token_states = decode(*inputs, self.step_params(), state.conv, state.recurrent, slots,
                                           cu_seqlens, use_state, keep_token_states=batch.keep_token_states)
            return o

        captures = batch.captures
        if captures is None:
            return run(None, None if batch.uniform else batch.cu_seqlens, batch.state_slots, batch.prefix_lens > 0)
        o_head = run(captures.head_rows, captures.head_cu, batch.state_slots, batch.prefix_lens > 0)
        slots = batch.state_slots[captures.seq_index]
        state.conv[captures.slot_index] = state.conv[slots]
        state.recurrent[captures.slot_index] = state.recurrent[slots]
        o = o_head.new_empty(qkv.shape[0], *o_head.shape[1:])
        o[captures.head_rows] = o_head
        o[captures.tail_rows] = run(captures.tail_rows, captures.tail_cu, slots,
                                    torch.ones_like(slots, dtype=torch.bool))
        return o

    def step_params(self) -> KDALayerParams:
        return KDALayerParams(self.conv_weight(), self.A_log, self.dt_bias, self.o_norm.weight, self.lower_bound,
                              self.o_norm.eps)

    def conv_weight(self) -> torch.Tensor:
        """[3*H*D, W] fp32: the q, k and v depthwise conv taps."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]

    def _prefill(self, qkv: torch.Tensor, gate_raw: torch.Tensor, beta_raw: torch.Tensor, batch: ForwardBatch,
                 state) -> torch.Tensor:
        """Short conv then chunked KDA over the new tokens: o [T, H, D] before the output norm. With captures
        (batch.captures), each captured sequence's conv state (its last W-1 inputs before the offset) and recurrent
        state (after the head rows' recurrence, before the tail's) are also copied into its capture's slot."""
        if state is None and batch.has_prefix:
            raise ValueError("a batch with cached prefixes needs the cache that holds them.")
        use_state = batch.prefix_lens > 0
        conv_state = None if state is None else torch.where(use_state.view(-1, 1, 1), state.conv[batch.state_slots], 0)
        y, conv_final = ops.causal_conv1d(qkv, self.conv_weight(), batch.cu_seqlens, conv_state)
        q, k, v = F.silu(y).view(qkv.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = l2_normalize(q), l2_normalize(k)
        g = decay_gate(gate_raw, self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(beta_raw.float())
        if state is None:                                  # training, or a plain forward: no pools to update
            return ops.chunk_kda(q, k, v, g, beta, batch.cu_seqlens)[0]
        state.conv[batch.state_slots] = conv_final.detach().to(state.conv.dtype)
        kda = backend.get_op("kda_prefill", qkv.device)
        captures = batch.captures
        if captures is None:
            return kda(q, k, v, g, beta, batch.cu_seqlens, state.recurrent, batch.state_slots, use_state)[0]
        for j, offset, slot, first in zip(captures.seqs, captures.offsets, captures.slots, captures.firsts):
            inputs = torch.cat([conv_state[j].to(qkv.dtype), qkv[first:first + offset]])
            state.conv[slot] = inputs[-state.conv.shape[1]:]
        head, tail = captures.head_rows, captures.tail_rows
        o_head = kda(q[head], k[head], v[head], g[head], beta[head], captures.head_cu, state.recurrent,
                     batch.state_slots, use_state)[0]
        o = o_head.new_empty(q.shape[0], *o_head.shape[1:])
        o[head] = o_head
        slots = batch.state_slots[captures.seq_index]
        state.recurrent[captures.slot_index] = state.recurrent[slots]
        o[tail] = kda(q[tail], k[tail], v[tail], g[tail], beta[tail], captures.tail_cu, state.recurrent, slots,
                      torch.ones_like(slots, dtype=torch.bool))[0]
        return o
