"""The Kimi K3 family decoder: KDA and gated MLA layers, AttnRes, (latent) MoE, MTP heads, lm_head.

Module names follow the checkpoints (`model.layers.{i}.self_attn.q_proj`, ...), so loading is a name lookup
except for the routed experts (stacked here) and A_log (held as [H]).

Forward API: one flat batch of many sequences' new tokens with explicit caches,

    hidden = model(input_ids [T], batch, cache)        # pre-final-norm hidden states [T, D]
    logits = model.compute_logits(hidden[rows])        # [R, vocab]

so the engine can run prefill chunks and decode steps of many requests in one call.

Built with a `Parallel` of more than one rank, the modules are those of one tensor-parallel rank: they are
constructed at full size and take their per-rank shapes from kestrel.distributed.sharding before the weights load
(models/checkpoint.py does both); compute_logits then returns the full vocabulary's logits on every rank.

Under DP attention (`par.attn` a rank's DP group) every rank runs the residual stream of every DP group's tokens,
group by group (batch.dp_tokens): the embedding, dense MLPs, MoE and LM head compute all of them, and each
attention sublayer attends only the rank's group's tokens (its caches hold only that group's sequences), then
gathers the groups' outputs (`DecoderLayer.attention`).

Under pipeline parallelism a rank builds only its stage's layers (the others are `AbsentLayer`s, so every layer
keeps its checkpoint name and index), the embedding on the first stage, the final norm, LM head and MTP layers on
the last (and a copy of the embedding there too with `embed_last_stage`, for the drafters that run on the last
stage: the MTP layers and block drafts embed the tokens they draft from). A stage runs `run_layers` on the
residual stream [n, T, D] it receives: the AttnRes block summaries finished so far and the running partial sum
(n = 1, the hidden states, without AttnRes), so

    hidden = model.model.finish(model.model.run_layers(model.model.start(input_ids), batch, cache))

is the whole forward, cut anywhere between layers.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..config import KDA, MLA, ModelConfig
from ..distributed.parallel import SINGLE, Parallel
from ..layers.batch import ForwardBatch
from ..layers.cache import HybridCache
from ..layers.kda import KimiDeltaAttention
from ..layers.linear import Linear
from ..layers.mla import GatedMLA
from ..layers.moe import MoE, GatedMLP
from ..layers.norm import RMSNorm
from ..layers.parallel import VocabParallelEmbedding, gather_vocab
from ..ops import backend


class DraftContext(Protocol):
    """A DFlash draft's context writer (kestrel.models.dflash_draft.ContextWriter): forwards over its cache hand it
    the outputs of its target layers."""

    cache: HybridCache
    target_layer_ids: tuple[int, ...]

    def write(self, outputs: torch.Tensor, batch: ForwardBatch) -> None:
        """Store the draft's context rows of batch's new tokens, from those layers' outputs [T, L * D]."""


class DecoderLayer(nn.Module):
    """Attention (KDA or MLA) then FFN (dense `mlp` or `block_sparse_moe`), each after an RMSNorm.

    With AttnRes the layer owns the two depth mixes that form its attention and FFN inputs
    (`self_attention_res_*`, `mlp_res_*`); otherwise the residual stream is a plain sum.
    """

    def __init__(self, config: ModelConfig, layer_id: int, kind: str, cache_index: int, attn_res: bool,
                 with_indexer: bool, par: Parallel = SINGLE):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.par = par
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if kind == KDA:
            self.self_attn = KimiDeltaAttention(config, cache_index, par.attn)
        else:
            self.self_attn = GatedMLA(config, cache_index, with_indexer, par.attn)
        if config.is_moe_layer(layer_id):
            self.block_sparse_moe = MoE(config, par)
        else:
            self.mlp = GatedMLP(config, d, config.intermediate_size, par.ffn)
        if attn_res:
            self.self_attention_res_norm = RMSNorm(d, eps)
            self.self_attention_res_proj = Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = Linear(d, 1, bias=False)

    @property
    def ffn(self) -> nn.Module:
        """The feed-forward block (dense `mlp` or `block_sparse_moe`), reading the post-attention-normed input."""
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache | None) -> torch.Tensor:
        """Plain pre-norm residual block, x [T, D] -> [T, D]."""
        x = x + self.attention(self.input_layernorm(x), batch, cache)
        return x + self.ffn(self.post_attention_layernorm(x))

    def attention(self, h: torch.Tensor, batch: ForwardBatch, cache: HybridCache | None) -> torch.Tensor:
        """The attention sublayer on its normed input h [T, D] -> [T, D]. Under DP attention h holds every DP
        group's tokens: this rank's group attends its own, and the groups' outputs are gathered; with the
        all-to-all MoE h holds the group's tokens only."""
        if batch.dp_tokens is None or self.par.layout.moe_a2a:
            return self.self_attn(h, batch, cache) if h.shape[0] else h
        first = sum(batch.dp_tokens[:self.par.layout.dp_rank])
        mine = h[first:first + batch.num_tokens]
        return self.par.dp_gather(self.self_attn(mine, batch, cache) if batch.num_tokens else mine, batch.dp_tokens)


class MTPLayer(DecoderLayer):
    """A DeepSeek-V3-style multi-token-prediction layer (`model.layers.{N+i}`), MLA attention, no AttnRes:

        h' = eh_proj([enorm(embed(token_{t+1})), hnorm(h_t)]);  h'' = DecoderLayer(h');
        logits_{t+2} = shared_head.head(shared_head.norm(h''))

    h_t is the main model's pre-final-norm hidden state. Whether K3.1's MTP attention has an indexer is unknown
    (model-spec 11.4); kestrel gives it none.
    """

    def __init__(self, config: ModelConfig, layer_id: int, cache_index: int, par: Parallel = SINGLE):
        super().__init__(config, layer_id, MLA, cache_index, attn_res=False, with_indexer=False, par=par)
        self.vocab_size = config.vocab_size
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = Linear(2 * d, d, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(d, eps)
        self.shared_head.head = Linear(d, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, batch: ForwardBatch,
                cache: HybridCache | None) -> torch.Tensor:
        """hidden, next_embeds [T, D] -> draft logits [T, vocab] for the token after next."""
        return self.head(self.body(hidden, next_embeds, batch, cache))

    def body(self, hidden: torch.Tensor, next_embeds: torch.Tensor, batch: ForwardBatch,
             cache: HybridCache | None) -> torch.Tensor:
        """hidden, next_embeds [T, D] -> h'' [T, D], the layer's output before the head (what a chained draft reads
        in place of the main model's hidden state)."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        return super().forward(x, batch, cache)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """h'' [T, D] -> logits [T, vocab]."""
        return gather_vocab(self.shared_head.head(self.shared_head.norm(x)), self.vocab_size, self.par.attn)


class AbsentLayer(nn.Module):
    """A decoder layer another pipeline stage holds (no weights here)."""


class KimiTextModel(nn.Module):
    """`model.*`: embeddings, the decoder layers (MTP layers last), final norm, AttnRes output mix; under pipeline
    parallelism only those of par's stage (see the module docstring)."""

    def __init__(self, config: ModelConfig, par: Parallel = SINGLE, embed_last_stage: bool = False):
        super().__init__()
        self.config = config
        self.par = par
        layout = par.layout
        self.stage = layout.stage_layers(config.num_hidden_layers)
        self.first_stage, self.last_stage = layout.first_stage, layout.last_stage
        d = config.hidden_size
        attn_res = config.attn_res_block_size is not None
        if self.first_stage or (self.last_stage and (config.tie_word_embeddings or embed_last_stage)):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d, par.attn)
        layers: list[nn.Module] = []
        counts = {KDA: 0, MLA: 0}           # the stage's own caches: cache indices count its layers only
        for i, kind in enumerate(config.layer_types):
            if i not in self.stage:
                layers.append(AbsentLayer())
                continue
            layers.append(DecoderLayer(config, i, kind, counts[kind], attn_res, config.has_indexer, par))
            counts[kind] += 1
        if self.last_stage:
            for j in range(config.num_nextn_predict_layers):
                layers.append(MTPLayer(config, config.num_hidden_layers + j, counts[MLA] + j, par))
        self.layers = nn.ModuleList(layers)
        self.draft_context: DraftContext | None = None
        """A DFlash draft's, when it drafts: the forward hands it its target layers' outputs at the new tokens."""
        if self.last_stage:
            self.norm = RMSNorm(d, config.rms_norm_eps)
            if attn_res:
                self.output_attn_res_norm = RMSNorm(d, config.rms_norm_eps)
                self.output_attn_res_proj = Linear(d, 1, bias=False)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """This stage's decoder layers (all of them in one stage)."""
        return [self.layers[i] for i in self.stage]

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: HybridCache | None,
                features: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """The whole decoder (one stage): input_ids [T] -> pre-final-norm hidden states [T, D]. features, when
        given, receives what HuggingFace's output_hidden_states[i + 1] holds for each of its keys i: -1, the
        embedding; the last layer, its output after the final norm; another layer, its output (see run_layers).
        Over a draft_context's cache, the draft's context rows of the new tokens are written beside the target's
        latents."""
        context = self.draft_context if self.draft_context is not None and self.draft_context.cache is cache else None
        if context is not None:
            features = {} if features is None else features
            features.update({i: None for i in context.target_layer_ids if i not in features})
        grouped = batch.dp_tokens is not None and self.par.layout.moe_a2a    # the stream stays with its group
        if grouped:
            first = sum(batch.dp_tokens[:self.par.layout.dp_rank])
            input_ids = input_ids[first:first + batch.num_tokens]
        stream = self.start(input_ids)
        if features is not None and -1 in features:
            features[-1] = stream[0]
        hidden = self.finish(self.run_layers(stream, batch, cache, features))
        if grouped:
            hidden = self.par.dp_gather(hidden, batch.dp_tokens)
        last = self.config.num_hidden_layers - 1
        if features is not None and last in features:
            features[last] = self.norm(hidden)
        if context is not None:
            context.write(torch.cat([features[i] for i in context.target_layer_ids], dim=-1), batch)
        return hidden

    def start(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream entering layer 0 [1, T, D]: the embedding."""
        return self.embed_tokens(input_ids).unsqueeze(0)

    def run_layers(self, stream: torch.Tensor, batch: ForwardBatch, cache: HybridCache | None,
                   features: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """This stage's layers: the stream entering its first layer -> the stream leaving its last. features, when
        given, receives the output [T, D] of each layer among its keys (with AttnRes, the running sum of the layer's
        block after it: what a forward hook on the layer sees in NeMo's K3 model)."""
        if self.config.attn_res_block_size is None:
            x = stream[0]
            for i, layer in zip(self.stage, self.decoder_layers):
                x = layer(x, batch, cache)
                if features is not None and i in features:
                    features[i] = x
            return x.unsqueeze(0)
        return self._run_attn_res(stream, batch, cache, features)

    def finish(self, stream: torch.Tensor) -> torch.Tensor:
        """The last stage: the stream leaving the last layer -> hidden states [T, D] (normed by compute_logits;
        with AttnRes, the output mix of every block)."""
        if self.config.attn_res_block_size is None:
            return stream[0]
        mix = backend.get_op("attn_res_mix_norm", stream.device)
        norm, proj = self.output_attn_res_norm, self.output_attn_res_proj
        return mix(stream, norm.weight, proj.weight[0], norm.eps, None, 0.0)

    def _run_attn_res(self, stream: torch.Tensor, batch: ForwardBatch, cache: HybridCache | None,
                      features: dict[int, torch.Tensor | None] | None) -> torch.Tensor:
        """AttnRes stream: `blocks` holds snapshots (the embedding, then each finished block's sum of sublayer
        outputs); `partial` is the running sum of the current block. Each sublayer reads a softmax mix of both."""
        mix = backend.get_op("attn_res_mix_norm", stream.device)

        def mixed(mix_norm: RMSNorm, proj: nn.Linear, next_norm: RMSNorm) -> torch.Tensor:
            """The softmax mix of blocks + [partial], RMSNormed by next_norm (one fused op)."""
            return mix(torch.stack(blocks + [partial]), mix_norm.weight, proj.weight[0], mix_norm.eps,
                       next_norm.weight, next_norm.eps)

        *blocks, partial = stream.unbind(0)
        for i in self.stage:
            layer = self.layers[i]
            if blocks:
                h = mixed(layer.self_attention_res_norm, layer.self_attention_res_proj, layer.input_layernorm)
            else:
                h = layer.input_layernorm(partial)
            if i % self.config.attn_res_block_size == 0:
                blocks.append(partial)
                partial = torch.zeros_like(partial)
            partial = partial + layer.attention(h, batch, cache)
            partial = partial + layer.ffn(mixed(layer.mlp_res_norm, layer.mlp_res_proj, layer.post_attention_layernorm))
            if features is not None and i in features:
                features[i] = partial
        return torch.stack(blocks + [partial])


class KimiForCausalLM(nn.Module):
    """The causal LM: `model.*` and `lm_head`; with `par`, one tensor-parallel rank's share of it (embed_last_stage:
    see the module docstring)."""

    def __init__(self, config: ModelConfig, par: Parallel = SINGLE, embed_last_stage: bool = False):
        super().__init__()
        self.config = config
        self.par = par
        self.model = KimiTextModel(config, par, embed_last_stage)
        if self.model.last_stage:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: HybridCache | None = None) -> torch.Tensor:
        """input_ids [T] (the new tokens of batch's sequences) -> pre-final-norm hidden states [T, D].

        With a cache, reads each sequence's state slot and pages and writes the new tokens into them.
        """
        if input_ids.shape != (batch.stream_tokens,):
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; the batch describes "
                             f"{batch.stream_tokens} tokens.")
        return self.model(input_ids, batch, cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, D] -> logits [R, vocab] in fp32."""
        return gather_vocab(self.lm_head(self.model.norm(hidden)).float(), self.config.vocab_size, self.par.attn)

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.model.layers[self.config.num_hidden_layers:])

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device if self.model.last_stage else self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the model's; a few parameters stay fp32)."""
        return self.model.layers[self.model.stage.start].input_layernorm.weight.dtype

    def mtp_logits(self, hidden: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch,
                   cache: HybridCache | None = None, depth: int = 0) -> torch.Tensor:
        """Draft logits [T, vocab] fp32 of MTP layer `depth`: at token t, from hidden[t] and the id of token t+1."""
        return self.mtp_head(self.mtp_hidden(hidden, next_ids, batch, cache, depth), depth)

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch,
                   cache: HybridCache | None = None, depth: int = 0) -> torch.Tensor:
        """MTP layer `depth`'s output h'' [T, D] (before its head), from which a chained draft continues."""
        return self.mtp_layers[depth].body(hidden, self.model.embed_tokens(next_ids), batch, cache)

    def mtp_head(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """h'' [R, D] of MTP layer `depth` -> its draft logits [R, vocab] fp32."""
        return self.mtp_layers[depth].head(x).float()
