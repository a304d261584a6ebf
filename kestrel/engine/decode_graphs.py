"""Decode steps replayed from CUDA graphs, so that one step is one host-to-device copy and one graph launch.

A decode step (one new token for each of n sequences) has shapes that depend only on n and on how many pages the
longest sequence spans. DecodeGraphs pads n up to the next captured batch size and the page-table width up to the
next power of two (so the indexer and attention work grows with the context, not with the context length), and
keeps one graph per (batch size, width), captured the first time the pair is needed. Every graph reads its inputs
from one static buffer (token ids, positions, state slots) and the device page table (rows by state slot), and
writes its logits into one static output, so graphs share everything but their recorded kernels (their
intermediates share one memory pool).

Padding rows are fresh sequences (position 0) in a scratch state slot, whose page-table row is all a scratch page;
the pools never hand either out, so padding computes values nobody reads and writes where nobody else reads.
Capturing runs the step once first (the warm-up that compiles the Triton kernels) with every row a padding row, so
that it never advances a real sequence.

Capture needs every op of the step free of host synchronisation and of shapes read from tensor values. The Triton
ops are (tests/engine/test_decode_graphs.py checks the whole step under the interpreter); the torch references
are not, so graphs are used only on CUDA with every decode op on its Triton kernel. Elsewhere the same static step
can run eagerly in place of a replay, which is how the tests check padding, buckets and capture on the CPU.

The same static step serves speculative verifications whose sequences all verify k drafts: k + 1 tokens per
sequence, every token's logits, hidden state (a model drafter reads them) and KDA state (the engine commits the
accepted token's). Those outputs are fresh tensors per call, so verifications run compiled or eagerly, never from
a CUDA graph (its outputs would need static buffers of every token's recurrent state); under CUDA graphs they run
as ordinary steps.

On the CPU the static step can be compiled (`--enable-torch-compile`): torch.compile traces each batch size's step
into one graph for every page-table width from 2 on (the width a dynamic dimension, which the model's branches on
the context length may split into ranges; a width of 1 gets its own), and inductor's C++ backend fuses its
elementwise work into loops (a batch of one's products by the weights too: kestrel.layers.linear.compiled_matvec),
so a step is one call instead of ~250 small ops per layer. The torch decode ops trace without host syncs (the routed
experts run per pair in the graph, or grouped as one custom op: kestrel.ops.torch.moe). Compiling a graph takes tens
of seconds on two cores (inductor caches the generated code on disk: kestrel.engine.compile_cache), and a step of a
new bucket waits for it; a step that fails to compile logs why and runs eagerly from then on. With
`--enable-background-compile` (experimental) it happens in the background instead
(kestrel.engine.background_compile): the first time a (batch size, width) bucket is needed it is asked for, and its
steps run on the eager path until it is ready (a bucket whose graph a wider one already compiled is ready at once).
The background compile runs the step once, on padding rows, against a copy of the cache's per-layer state objects
(the step's Python side effects, each KDA layer's token_states, land on the copy; the tensors are the same, and
padding writes only where nobody reads).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..layers.batch import ForwardBatch
from ..layers.cache import HybridCache
from ..models.kimi import KimiForCausalLM
from ..ops import backend
from ..ops.torch.kda_decode import TokenStates
from .background_compile import BackgroundCompiler
from .cache.page_table import PageTable

log = logging.getLogger("kestrel")

DECODE_OPS = ("kda_decode", "paged_mla_decode", "paged_indexer_scores", "paged_indexer_topk", "moe_experts",
              "attn_res_mix_norm")
"""The dispatched ops a decode step runs."""


class StepOutputs(NamedTuple):
    """A static step's results for its n real sequences of q tokens each (T = n * q rows, sequence-major)."""

    logits: torch.Tensor                      # [T, vocab] fp32
    hidden: torch.Tensor | None               # [T, D]: the final hidden states (what a model drafter reads);
                                              # None from a CUDA graph (no model drafter runs with graphs)
    token_states: tuple[TokenStates, ...]     # verifications (q > 1): each KDA layer's states after every token


def compile_options(backend: str) -> dict:
    """torch.compile options for a forward over fixed weights (see DecodeGraphs): module guards skipped, and under
    inductor its freezing path without a oneDNN-packed copy (the weights stay inputs: DecodeGraphs), and the
    wrapper code in C++."""
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if backend == "inductor":
        options.update({"cpp_wrapper": True, "freezing": True, "cpp.weight_prepack": False})
    return options


def graphs_supported(device: torch.device) -> bool:
    """Whether decode steps on `device` can be captured: CUDA, with every decode op on its Triton kernel."""
    return device.type == "cuda" and all(backend.backend_for(op, device) == backend.TRITON for op in DECODE_OPS)


def batch_sizes(max_batch_size: int) -> list[int]:
    """The captured batch sizes, SGLang's set: 1, 2, 4, then every multiple of 8, and max_batch_size itself."""
    return sorted({*(b for b in (1, 2, 4) if b < max_batch_size), *range(8, max_batch_size, 8), max_batch_size})


class DecodeGraphs:
    """Decode steps of up to max_batch_size sequences, their pages in page_table, as graph replays; without
    capture, also verifications of up to max_tokens_per_seq tokens per sequence.

    scratch_slot: a state slot of `cache` that nothing else uses, its page-table row all a page nothing else uses.
    capture: record CUDA graphs (default: on CUDA devices); otherwise each replay runs the static step eagerly, or
    compiled by torch.compile with the backend `compile` names ("inductor": the CPU's fast path; the tests also
    use "aot_eager", which traces the same graph without generating code). background: compile on its thread
    instead of at first use (see `available`).
    """

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, page_table: PageTable, max_batch_size: int,
                 scratch_slot: int, capture: bool | None = None, compile: str | None = None,
                 max_tokens_per_seq: int = 1, background: BackgroundCompiler | None = None):
        self.model, self.cache, self.page_table = model, cache, page_table
        self.device = model.device
        self.sizes = batch_sizes(max_batch_size)
        self.scratch_slot = scratch_slot
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.max_tokens_per_seq = 1 if self.capture else max_tokens_per_seq
        self.forward = self._forward
        self.background = background if compile else None
        if compile:
            # One graph per batch size for a width of one page, and one (or, where the model branches on the
            # context length, a few) for the wider (the width is dynamic: _step); the model's weights are never
            # replaced while it serves, so their guards are skipped (they cost ~0.6 ms per call on the bundled
            # model). Inductor compiles on its freezing path, told not to repack weights for oneDNN (weight_prepack:
            # a second, packed copy of each), but the weights stay inputs of the graph: dynamo lifts them as
            # attributes, which freezing makes constants, only while the global torch._inductor.config.freezing is
            # set as it traces, and options reach inductor after that. Set globally, it made them constants (the
            # bundled model's step 145 inputs instead of 163) and that model's batch-1 decode ran 0.95x as fast
            # (medians of 8 alternating rounds in one process), so it stays unset. Inductor writes the code that
            # calls its kernels in C++ too (cpp_wrapper): a Python wrapper spends ~0.3 ms per step on the bundled
            # model allocating and checking buffers, for twice the compile time.
            widths = page_table.max_pages.bit_length() + 1
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, len(self.sizes) * widths * self.max_tokens_per_seq)
            self.forward = torch.compile(self._forward, backend=compile, dynamic=False, fullgraph=True,
                                         options=compile_options(compile))
        self.token_ids = torch.zeros(max_batch_size * self.max_tokens_per_seq, dtype=torch.long, device=self.device)
        self.inputs = torch.zeros(2, max_batch_size, dtype=torch.long, device=self.device)  # prefix lengths, slots
        # the background compile's own inputs, made as the engine's are (dynamo's guards tell an inference-mode
        # tensor, which the compile thread would make, from these: a mismatch compiled again on the engine thread)
        self.padding_inputs = (torch.zeros_like(self.token_ids), torch.zeros_like(self.inputs)) if background else None
        self.steps: dict[tuple[int, int, int], Callable[[], StepOutputs]] = {}
        """The replay of each captured (batch size, width, tokens per sequence): reads self.token_ids and
        self.inputs."""
        self.pool = None
        if self.capture:           # a graph's logits live in a static buffer outside its memory pool
            self.logits = torch.empty(max_batch_size, model.config.vocab_size, device=self.device)
            self.pool = torch.cuda.graph_pool_handle()

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def fits(self, num_seqs: int, longest: int, tokens_per_seq: int = 1) -> bool:
        """Whether a step of num_seqs sequences of tokens_per_seq tokens, the longest spanning `longest` pages, has
        a graph size."""
        return (1 <= num_seqs <= self.max_batch_size and longest <= self.page_table.max_pages
                and 1 <= tokens_per_seq <= self.max_tokens_per_seq)

    def available(self, num_seqs: int, longest: int, tokens_per_seq: int = 1) -> bool:
        """Whether such a step (see fits) can run as a graph now. Compiling in the background, only once its graph
        is compiled: the first time it is not, this asks for it."""
        if not self.fits(num_seqs, longest, tokens_per_seq):
            return False
        if self.background is None:
            return True
        key = self._key(num_seqs, longest, tokens_per_seq)
        if key not in self.steps:
            self.background.ask(("decode step", *key), lambda: self._compile_in_background(*key))
            return False
        return True

    def _key(self, num_seqs: int, longest: int, tokens_per_seq: int) -> tuple[int, int, int]:
        """The (batch size, width, tokens per sequence) of the graph that runs such a step."""
        size = next(b for b in self.sizes if b >= num_seqs)
        return size, min(1 << (longest - 1).bit_length(), self.page_table.max_pages), tokens_per_seq

    def run(self, token_ids: list[int], prefix_lens: list[int], slots: list[int], longest: int,
            tokens_per_seq: int = 1) -> StepOutputs:
        """One step of n sequences: sequence i adds token_ids[i*q:(i+1)*q] (q = tokens_per_seq; more than 1: a
        verification, which leaves the KDA pools as they were) from position prefix_lens[i], with its state in
        slots[i] and its pages in that slot's page-table row; the longest spans `longest` pages. CUDA graphs'
        results are overwritten by the next run."""
        n, q = len(slots), tokens_per_seq
        size, width, q = self._key(n, longest, q)
        replay = self.steps.get((size, width, q)) or self._capture(size, width, q)
        pad = size - n
        self.token_ids[:size * q].copy_(torch.tensor([*token_ids, *[0] * (pad * q)]), non_blocking=True)
        values = [*prefix_lens, *[0] * pad, *slots, *[self.scratch_slot] * pad]
        self.inputs[:, :size].copy_(torch.tensor(values).view(2, size), non_blocking=True)
        out = replay()
        return StepOutputs(out.logits[:n * q], None if out.hidden is None else out.hidden[:n * q],
                           out.token_states)

    def _capture(self, size: int, width: int, q: int) -> Callable[[], StepOutputs]:
        ids, (prefix, slots) = self.token_ids[:size * q], self.inputs[:, :size]
        ids.zero_()
        prefix.zero_()
        slots.fill_(self.scratch_slot)

        step = self._step(ids, prefix, slots, width, q, self.cache)
        # warm-up: compiles kernels, initialises libraries
        self._forward(ids, prefix, slots, self.page_table.gather(slots, width), q, self.cache)
        if self.forward is not self._forward:
            try:
                step()
            except Exception as e:      # inductor failed (no C++ compiler, an op it cannot trace): run eagerly
                log.warning("decode: torch.compile failed, decoding eagerly from now on: %s", e)
                self.forward = self._forward
        if not self.capture:
            replay = step
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = step()

            def replay() -> StepOutputs:
                graph.replay()
                return outputs
        self.steps[(size, width, q)] = replay
        return replay

    def _compile_in_background(self, size: int, width: int, q: int) -> None:
        """Compile the (size, width, q) step by running it on padding rows, from input buffers laid out as the
        engine's and against a copy of the cache's state objects (see the module's docstring); then the engine's
        steps of that key run it."""
        token_ids, inputs = self.padding_inputs
        inputs[1].fill_(self.scratch_slot)
        ids, (prefix, slots) = token_ids[:size * q], inputs[:, :size]
        shadow = dataclasses.replace(self.cache, kda=[dataclasses.replace(s, token_states=None)
                                                      for s in self.cache.kda])
        self._step(ids, prefix, slots, width, q, shadow)()
        self.steps[(size, width, q)] = self._step(self.token_ids[:size * q], *self.inputs[:, :size], width, q,
                                                  self.cache)

    def _step(self, ids: torch.Tensor, prefix: torch.Tensor, slots: torch.Tensor, width: int, q: int,
              cache: HybridCache) -> Callable[[], StepOutputs]:
        """The step that reads ids, prefix and slots (see _forward) where they are when it is called, and the
        first `width` columns of their page-table rows. Compiled, the width is a dynamic dimension from 2 on,
        which the model's own branches on the context length split into ranges (the indexer's top-k, say)."""
        size = len(slots)

        def step() -> StepOutputs:
            table = self.page_table.gather(slots, width)
            if width > 1 and self.forward is not self._forward:
                torch._dynamo.maybe_mark_dynamic(table, 1)
            logits, hidden, states = self.forward(ids, prefix, slots, table, q, cache)
            if self.capture:
                self.logits[:size].copy_(logits)
                logits, hidden = self.logits[:size], None
            return StepOutputs(logits, hidden, tuple(TokenStates(*s) for s in states))
        return step

    def _forward(self, ids: torch.Tensor, prefix: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, q: int,
                 cache: HybridCache
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
        """The step of ids [size * q] from prefix lengths and slots [size], their pages in table [size, width],
        over cache: logits [size * q, vocab], hidden states [size * q, D] and, for a verification, each KDA layer's
        (conv, recurrent) states after every token."""
        batch = ForwardBatch.for_decode(prefix, slots, table, cache.page_size, q)
        hidden = self.model(ids, batch, cache)
        states = tuple((s.token_states.conv, s.token_states.recurrent) for s in cache.kda) if q > 1 else ()
        return self.model.compute_logits(hidden), hidden, states
