"""Gated NoPE multi-head latent attention (K3, Kimi-Linear) and its sparse form with a lightning indexer (K3.1 Pro).

Per token the cache holds 512 + 64 values per layer: the normalised KV latent and the head-shared key part that
K3 never rotates. Two mathematically equal forms read it (model-spec 5.1, 5.2):
- plain: expand every cached latent through kv_b_proj into per-head keys and values (cheap for long prefills);
- absorbed: fold kv_b_proj into the query and the output, attending over the latent directly (cheap for decode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..ops import backend
from ..ops.torch.indexer import topk_positions
from ..distributed.parallel import SINGLE, Parallel
from . import dcp
from .batch import ForwardBatch
from .cache import HybridCache, PagedRows
from .linear import Linear, LinearGroup
from .norm import RMSNorm
from .parallel import RowParallelLinear

PLAIN, ABSORBED, AUTO = "plain", "absorbed", "auto"


def _gathered(rows: PagedRows, batch: ForwardBatch, dtype: torch.dtype) -> torch.Tensor:
    """Every position of every sequence of the batch from its pages, [N, max_total, D] in dtype, zeros past each
    sequence's end (rows there may never have been written)."""
    written = torch.arange(batch.max_total, device=rows.values.device) < batch.seq_lens.unsqueeze(1)
    return torch.where(written.unsqueeze(-1), rows.read(batch.kv_read_index, dtype), 0)


class LightningIndexer(nn.Module):
    """Scores every past token for each query and keeps the top-k (DeepSeek-V3.2's indexer without RoPE).

    I[t, s] = sum_h w[t, h] relu(qI[t, h] . kI[s]) / sqrt(D), with qI from the query latent, kI = LayerNorm(wk x),
    w = weights_proj(x) / sqrt(heads). The Hadamard rotation and FP8 rounding of DeepSeek's kernels are omitted:
    the rotation is orthogonal, so exact scores are unchanged.

    Under tensor parallelism each rank scores with its Hi / tp heads (the keys are shared by all heads, so wk and
    k_norm are replicated) and `reduce` sums the partial scores over the ranks before top-k, so every rank selects
    the same positions.
    """

    def __init__(self, config: ModelConfig, par: Parallel = SINGLE):
        super().__init__()
        self.par = par
        heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.num_heads, self.weight_scale = heads // par.tp_size, heads ** -0.5
        self.wq_b = Linear(config.q_lora_rank, heads * self.head_dim, bias=False)
        self.wk = Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=config.rms_norm_eps, bias=config.index_k_norm_bias)
        self.weights_proj = Linear(config.hidden_size, heads, bias=False)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> index keys [T, D] (what the indexer-key cache stores)."""
        bias = None if self.k_norm.bias is None else self.k_norm.bias.float()
        k = F.layer_norm(self.wk(x).float(), (self.head_dim,), self.k_norm.weight.float(), bias, self.k_norm.eps)
        return k.to(x.dtype)

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's index queries [T, Hi/tp, D] and their head weights [T, Hi/tp] fp32 (scaled by Hi^-0.5)."""
        q = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)
        return q, self.weights_proj(x).float() * self.weight_scale

    def reduce(self, partial_scores: torch.Tensor) -> torch.Tensor:
        """The scores of all heads from every rank's partial scores (-inf where masked on every rank)."""
        return self.par.all_reduce(partial_scores.contiguous())

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, context_keys: torch.Tensor, batch: ForwardBatch,
               mask: torch.Tensor) -> torch.Tensor:
        """Index scores [N, L, S] fp32 (-inf where mask is False) of the new tokens against context_keys [N, S, D]."""
        q, weights = self.queries(x, q_latent)
        return self.reduce(ops.indexer_scores(batch.to_padded(q), context_keys, batch.to_padded(weights), mask))

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, keys: PagedRows, batch: ForwardBatch,
               tokens_per_seq: int) -> torch.Tensor:
        """The topk positions [T, min(topk, max_total)] int64 (best first, -1 past a token's visible keys) of the new
        tokens x [T, hidden] among their sequences' cached index keys (the new ones written): one selection op
        with all heads here. Under tensor parallelism the ranks' partial scores are summed first: a decode step's
        [T, S] at once, a longer step's block by block over its gathered keys (`ops.indexer_topk`), never [T, S]."""
        q, weights = self.queries(x, q_latent)
        args = (q, weights, keys.values, keys.scales, batch.page_table, batch.page_size, batch.seq_index,
                batch.positions, batch.max_total)
        if self.par.tp_size == 1:
            return backend.get_op("paged_indexer_topk", x.device)(*args, self.topk, tokens_per_seq)
        if batch.max_new == 1:
            return topk_positions(self.reduce(backend.get_op("paged_indexer_scores", x.device)(*args)), self.topk)
        last = batch.to_padded(batch.positions + 1) - 1                              # -1 marks padding rows
        return batch.from_padded(ops.indexer_topk(batch.to_padded(q), _gathered(keys, batch, q.dtype),
                                                  batch.to_padded(weights), last, self.topk, self.reduce))


class GatedMLA(nn.Module):
    """One MLA layer (`self_attn.*` in checkpoints): NoPE, optional sigmoid output gate, optional indexer.

    mla_index: the layer's position among the model's MLA layers (its pages in a HybridCache).
    form: PLAIN, ABSORBED, or AUTO (absorbed for decode steps and speculative verifications, which bring one or a
    few new tokens per sequence; plain otherwise).
    Under tensor parallelism each rank runs num_heads = H / tp heads: the latent projections (q_a, kv_a) and the
    cached latents are replicated, the head projections (q_b, kv_b, g) split, o_proj row-parallel. With decode
    context parallelism the cached latents are split by position instead (kestrel.layers.dcp).
    """

    def __init__(self, config: ModelConfig, mla_index: int, with_indexer: bool, par: Parallel = SINGLE):
        super().__init__()
        self.par = par
        self.mla_index = mla_index
        self.num_heads = config.num_attention_heads // par.tp_size
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.latent_dim = config.kv_lora_rank
        self.scale = config.qk_head_dim ** -0.5
        self.form = AUTO
        hidden, heads = config.hidden_size, config.num_attention_heads
        if config.q_lora_rank:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.mla_norm_eps)
            self.q_b_proj = Linear(config.q_lora_rank, heads * config.qk_head_dim, bias=False)
        else:
            self.q_proj = Linear(hidden, heads * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, config.kv_cache_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.mla_norm_eps)
        self.kv_b_proj = Linear(config.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        if config.mla_output_gate:
            self.g_proj = Linear(hidden, heads * self.v_dim, bias=False)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, par)
        self.indexer = LightningIndexer(config, par) if with_indexer else None
        projections = ("q_a_proj", "q_proj", "kv_a_proj_with_mqa", "g_proj")       # of x: query, latent, gate
        self.inputs = LinearGroup(*(getattr(self, name) for name in projections if hasattr(self, name)))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache | None = None,
                index_scores_out: list | None = None, attention_out: list | None = None) -> torch.Tensor:
        """x: [T, hidden] (after input_layernorm) -> [T, hidden].

        Writes the new tokens' latents (and index keys) to the cache, then attends over each whole sequence.
        index_scores_out, when given, receives the indexer's scores [N, L, S] (indexer training uses them);
        attention_out receives the heads' mean attention distribution (see attention_distribution).
        """
        num_tokens = x.shape[0]
        q, q_latent, latent, gate = self.project(x)
        index_keys = self.indexer.keys(x) if self.indexer is not None else None

        if cache is not None and self.par.layout.dcp_size > 1:
            o = self._context_parallel(x, q, q_latent, latent, index_keys, batch, cache)
        elif cache is not None and self._paged_form(batch) and index_scores_out is None and attention_out is None:
            o = self._absorbed_paged(x, q, q_latent, latent, index_keys, batch, cache)
        else:
            o = self._attend_context(x, q, q_latent, latent, index_keys, batch, cache, index_scores_out,
                                     attention_out)
        return self.output(o.reshape(num_tokens, -1), gate)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] -> queries [T, H, 192], the query latent [T, q_lora_rank] (None without Q-LoRA), the
        latents to cache [T, 576] (normed c_kv, then the head-shared key part) and the output gate's logits
        [T, H * v_dim] (None without the gate)."""
        q, kv, *gate = self.inputs(x)
        if hasattr(self, "q_a_proj"):
            q_latent = self.q_a_layernorm(q)
            q = self.q_b_proj(q_latent)
        else:
            q_latent = None
        q = q.view(x.shape[0], self.num_heads, self.nope_dim + self.rope_dim)
        return q, q_latent, self._normed_latents(kv), gate[0] if gate else None

    def output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The heads' outputs o [T, H * v_dim] -> [T, hidden]: gated (when the layer has a gate), then o_proj."""
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the latents its tokens would cache [T, 576]."""
        return self._normed_latents(self.kv_a_proj_with_mqa(x))

    def _normed_latents(self, kv: torch.Tensor) -> torch.Tensor:
        """kv_a_proj_with_mqa's output [T, 576] -> the cached latents: c_kv [T, 512] normed, the shared key part
        as it is."""
        return torch.cat([self.kv_a_layernorm(kv[:, :self.latent_dim]), kv[:, self.latent_dim:]], dim=-1)

    def attend_block(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Blocks of tokens attending, without a causal order, to their context and to each other (a DFlash draft's
        layers, kestrel.models.dflash_draft): x [N, B, hidden] (normed), context [N, S, 576] (cached latents),
        mask [N, B, S + B] bool (the keys [context | block] each block token sees) -> [N, B, hidden]."""
        n, b = x.shape[:2]
        q, _, latent, gate = self.project(x.flatten(0, 1))
        keys = torch.cat([context.to(latent.dtype), latent.view(n, b, -1)], dim=1)
        o = self._absorbed(q.view(n, b, self.num_heads, -1), keys, mask)
        return self.output(o.reshape(n * b, -1), gate).view(n, b, -1)

    def _absorbed_paged(self, x: torch.Tensor, q: torch.Tensor, q_latent: torch.Tensor | None, latent: torch.Tensor,
                        index_keys: torch.Tensor | None, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        """The absorbed form straight over the pages (decode steps, and every step of a sparse layer past its
        top-k): q [T, H, 192] -> [T, H, v_dim]."""
        pages = cache.mla[self.mla_index]
        pages.latent.write(batch.kv_write_index, latent)
        group = batch.max_new if batch.uniform else 1      # a verification of equal drafts reads each context once
        selected = None
        if self.indexer is not None:
            pages.index_keys.write(batch.kv_write_index, index_keys)
            selected = self.indexer.select(x, q_latent, pages.index_keys, batch, group)
        w_uk, w_uv = self._absorption()
        q_nope, q_shared = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_full = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_shared], dim=-1)
        o_latent = backend.get_op("paged_mla_decode", x.device)(
            q_full, pages.latent.values, pages.latent.scales, batch.page_table, cache.page_size, batch.seq_index,
            batch.positions, self.scale, self.latent_dim, selected, group)
        return torch.einsum("thr,hvr->thv", o_latent, w_uv)

    def _context_parallel(self, x: torch.Tensor, q: torch.Tensor, q_latent: torch.Tensor | None,
                          latent: torch.Tensor, index_keys: torch.Tensor | None, batch: ForwardBatch,
                          cache: HybridCache) -> torch.Tensor:
        """Attention over the positions split across the DCP ranks (prefill and decode; kestrel.layers.dcp):
        q [T, H/tp, 192] -> [T, H/tp, v_dim]."""
        par, pages = self.par, cache.mla[self.mla_index]
        rank, size = par.layout.dcp_rank, par.layout.dcp_size
        mine = batch.positions % size == rank
        rows = dcp.cache_rows(batch.page_table, batch.seq_index, batch.positions, cache.page_size, size)[mine]
        held, reached = dcp.held_positions(batch, rank, size)
        read = torch.where(reached, dcp.cache_rows(batch.page_table, torch.arange(batch.num_seqs, device=x.device)
                                                   .unsqueeze(1), held, cache.page_size, size), 0)
        pages.latent.write(rows, latent[mine])
        context = torch.where(reached.unsqueeze(-1), pages.latent.read(read, latent.dtype), 0)
        mask = held.unsqueeze(1) <= (batch.to_padded(batch.positions + 1) - 1).unsqueeze(-1)     # [N, L, S']
        if self.indexer is not None:
            pages.index_keys.write(rows, index_keys[mine])
            keys = torch.where(reached.unsqueeze(-1), pages.index_keys.read(read, index_keys.dtype), 0)
            index_q, weights = self.indexer.queries(x, q_latent)
            local = par.cross_all_reduce(ops.indexer_scores(batch.to_padded(dcp.gather_heads(index_q, par)), keys,
                                                            batch.to_padded(dcp.gather_heads(weights, par)), mask))
            scores = dcp.gather_positions(local, par)
            mask = ops.topk_mask(scores, scores > float("-inf"), self.indexer.topk)[..., rank::size]
        w_uk, w_uv = self._absorption()
        q_nope, q_shared = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_full = dcp.gather_heads(torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_shared], dim=-1), par)
        out, lse = dcp.partial_attention(batch.to_padded(q_full), context, mask, self.scale, self.latent_dim)
        mine_heads = slice(rank * self.num_heads, (rank + 1) * self.num_heads)
        o_latent = dcp.merge_partials(out, lse, par)[:, :, mine_heads].to(w_uv.dtype)
        return batch.from_padded(torch.einsum("nlhr,hvr->nlhv", o_latent, w_uv))

    def _attend_context(self, x: torch.Tensor, q: torch.Tensor, q_latent: torch.Tensor | None, latent: torch.Tensor,
                        index_keys: torch.Tensor | None, batch: ForwardBatch, cache: HybridCache | None,
                        index_scores_out: list | None, attention_out: list | None) -> torch.Tensor:
        """Attention over each sequence's whole context gathered in a padded batch: q [T, H, 192] -> [T, H, v]."""
        context, context_keys = self._context(latent, index_keys, batch, cache)
        if (self.indexer is not None and context.shape[1] > self.indexer.topk and index_scores_out is None
                and attention_out is None):
            return batch.from_padded(self._sparse(x, q, q_latent, context, context_keys, batch))
        mask = self._causal_mask(batch, context.shape[1])
        if self.indexer is not None:
            scores = self.indexer.scores(x, q_latent, context_keys, batch, mask)
            if index_scores_out is not None:
                index_scores_out.append(scores)
            mask = ops.topk_mask(scores, mask, self.indexer.topk)
        q = batch.to_padded(q)
        if attention_out is not None:
            attention_out.append(self.attention_distribution(q, context, mask))
        attend = self._absorbed if self._absorbed_form(batch) else self._plain
        return batch.from_padded(attend(q, context, mask))

    def _sparse(self, x: torch.Tensor, q: torch.Tensor, q_latent: torch.Tensor | None, context: torch.Tensor,
                context_keys: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention over the indexer's top-k keys only, when the context holds more (without a cache; with one,
        `_absorbed_paged` reads the selected latents in place): q [T, H, 192], context
        [N, S, 576], context_keys [N, S, D] -> [N, L, H, v_dim]. The indexer scores its keys block by block
        (`ops.indexer_topk`) and each query reads its own top-k latents in the absorbed form (DeepSeek-V3.2's sparse
        MQA mode; the plain form would expand K keys per query and head), so neither a [L, S] score matrix nor
        attention over all S keys is formed; equal to the masked form (topk_mask, then attention under the mask)."""
        index_q, weights = self.indexer.queries(x, q_latent)
        last = batch.to_padded(batch.positions + 1) - 1                              # -1 marks padding rows
        selected = ops.indexer_topk(batch.to_padded(index_q), context_keys, batch.to_padded(weights), last,
                                    self.indexer.topk, self.indexer.reduce)
        w_uk, w_uv = self._absorption()
        q_nope, q_shared = batch.to_padded(q).split([self.nope_dim, self.rope_dim], dim=-1)
        q_full = torch.cat([torch.einsum("nlhd,hdr->nlhr", q_nope, w_uk), q_shared], dim=-1)
        latent = context.unsqueeze(2)
        o_latent = ops.sparse_attention(q_full, latent, latent[..., :self.latent_dim], selected, self.scale)
        return torch.einsum("nlhr,hvr->nlhv", o_latent, w_uv)

    def _absorbed_form(self, batch: ForwardBatch) -> bool:
        return self.form == ABSORBED or (self.form == AUTO and (batch.max_new == 1 or batch.keep_token_states))

    def _paged_form(self, batch: ForwardBatch) -> bool:
        """Whether a step with a cache attends straight over the pages (`_absorbed_paged`): in the absorbed form,
        and whenever the indexer keeps fewer keys than the context holds (each token then reads its selected
        latents only, where the gathered context would grow with it)."""
        return self._absorbed_form(batch) or (self.indexer is not None and batch.max_total > self.indexer.topk)

    def _context(self, latent: torch.Tensor, index_keys: torch.Tensor | None, batch: ForwardBatch,
                 cache: HybridCache | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every token of every sequence, [N, S, 576] latents and [N, S, D] index keys, from the cache if any."""
        if cache is None:
            if batch.has_prefix:
                raise ValueError("a batch with cached prefixes needs the cache that holds them.")
            keys = batch.to_padded(index_keys) if index_keys is not None else None
            return batch.to_padded(latent), keys
        pages = cache.mla[self.mla_index]
        pages.latent.write(batch.kv_write_index, latent)
        keys = None
        if index_keys is not None:
            pages.index_keys.write(batch.kv_write_index, index_keys)
            keys = _gathered(pages.index_keys, batch, index_keys.dtype)
        return _gathered(pages.latent, batch, latent.dtype), keys

    @staticmethod
    def _causal_mask(batch: ForwardBatch, context_len: int) -> torch.Tensor:
        """[N, L, S] bool: new token l of sequence n may see position s <= its own (padding rows see nothing)."""
        positions = batch.to_padded(batch.positions + 1) - 1        # -1 marks padding rows
        return torch.arange(context_len, device=positions.device) <= positions.unsqueeze(-1)

    def _plain(self, q: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [N, L, H, 192], context [N, S, 576] -> [N, L, H, v_dim]; keys and values expanded per head."""
        k, v = self._expand(context)
        return ops.masked_attention(q, k, v, mask, self.scale)

    def _expand(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """context [N, S, 576] -> per-head keys [N, S, H, 192] and values [N, S, H, v_dim]."""
        n, s = context.shape[:2]
        kv = self.kv_b_proj(context[..., :self.latent_dim]).view(n, s, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_shared = context[..., self.latent_dim:].unsqueeze(2).expand(-1, -1, self.num_heads, -1)
        return torch.cat([k_nope, k_shared], dim=-1), v

    @torch.no_grad()
    def attention_distribution(self, q: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The attention probabilities averaged over heads, [N, L, S] fp32 without gradient (zero where mask is
        False): the target of DeepSeek-V3.2's indexer training, and what indexer selection should recover.

        q [N, L, H, 192], context [N, S, 576], mask [N, L, S] bool (the keys this layer attends to).
        """
        k, _ = self._expand(context)
        scores = torch.einsum("nlhd,nshd->nhls", q.float(), k.float()) * self.scale
        probs = torch.softmax(scores.masked_fill(~mask.unsqueeze(1), torch.finfo(torch.float32).min), dim=-1)
        return (probs * mask.unsqueeze(1)).mean(1)

    def _absorption(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into W_UK [H, nope, 512] (folded into the query) and W_UV [H, v, 512]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.latent_dim)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def _absorbed(self, q: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [N, L, H, 192], context [N, S, 576] -> [N, L, H, v_dim]; attention over the shared latent."""
        w_uk, w_uv = self._absorption()
        q_nope, q_shared = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent = torch.einsum("nlhd,hdr->nlhr", q_nope, w_uk)
        q_full = torch.cat([q_latent, q_shared], dim=-1)
        o_latent = ops.masked_attention(q_full, context.unsqueeze(2), context[..., :self.latent_dim].unsqueeze(2),
                                        mask, self.scale)
        return torch.einsum("nlhr,hvr->nlhv", o_latent, w_uv)
