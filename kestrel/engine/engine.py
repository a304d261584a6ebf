"""The engine loop: admit requests, run scheduled steps, sample, detokenize, stop, and release memory at once.

A request with structured outputs waits outside the scheduler until its grammar is compiled (on the grammar
compiler's threads, structured.py), so a long compile never holds up the other requests' steps."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple
from weakref import WeakKeyDictionary

import torch

from ..distributed.layout import ParallelLayout
from ..distributed.parallel import SINGLE
from ..ops import batch_invariant, cpu
from ..ops.torch.kda import compile_chunk_terms
from . import deterministic
from .args import MODEL_DRAFTERS, EngineArgs
from .background_compile import BackgroundCompiler, module_calls
from .cache.device_ops import DeviceOps
from .cache.kv_pool import KVPool
from .cache.page_table import PageTable
from .cache.prefix_setup import build_prefix_cache
from .cache.state_pool import StatePool
from .compile_cache import use_compile_cache
from .decode_graphs import DecodeGraphs, graphs_supported
from .dp_scheduler import DPScheduler
from .handoff import Handoff, handoff_parts, split_context
from .model_runner import PREFILL_TERMS, ModelRunner
from .outputs import Logprob, RequestOutput, TokenLogprobs
from .pacer import PrefillPacer
from .ranks import Ranks, load_shard, model_drafter
from .request import Request, Sequence, Status
from .sampling import (SampleResult, SamplingParams, SamplingRow, finite_rows, gather_logprobs,
                       model_sampling_defaults, new_generator, raw_logprobs, sample)
from .scheduler import ScheduledChunk, Scheduler
from .speculative import ngram
from .speculative.mtp import DraftInput
from .speculative.standalone import StandaloneDrafter
from .speculative.stats import SpecStats
from .speculative.verify import verify
from .structured import GrammarCompiler
from .tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("kestrel")

COMPILE_POLL_S = 0.05
"""With nothing to run but grammars compiling, a step waits this long for one of them."""


class Computed(NamedTuple):
    """Positions start..start+length-1 of seq that a forward just computed and kept, for a model drafter: their
    hidden states are rows first_row.. of the forward-th hidden states the runner kept (ModelRunner.kept)."""

    seq: Sequence
    start: int
    forward: int
    first_row: int
    length: int


class LLMEngine:
    """Continuous batching over one model: add_request, then step() until has_unfinished_requests() is False."""

    def __init__(self, args: EngineArgs):
        if (reason := deterministic.refusal(args)) is not None:
            raise ValueError(reason)
        self.args = args
        folder, layout = Path(args.model), ParallelLayout.from_args(args)
        self.ranks = Ranks(args, layout) if layout.world_size > 1 else None
        device = self.ranks.device if self.ranks else torch.device(args.device)
        graphs = not args.disable_cuda_graph and graphs_supported(device)
        mode = args.torch_compile(device)
        compiled = mode is not None
        if (args.enable_torch_compile or args.enable_background_compile) and not compiled:
            log.info("decode: --enable-torch-compile and --enable-background-compile compile CPU decode steps; on %s, "
                     "CUDA graphs replay them", device.type)
        if graphs and args.speculative_algorithm in MODEL_DRAFTERS:
            graphs = False
            log.info("decode: CUDA graphs are not used with model drafters yet (a graph hands back no hidden states, "
                     "and verifications would need static per-token state buffers)")
        graphs = graphs or compiled
        if graphs and self.ranks:
            log.info("decode: CUDA graphs and compiled steps are not used with more than one rank yet; decoding "
                     "eagerly")
        try:
            shard = load_shard(args, self.ranks.par if self.ranks else SINGLE, device,
                               self.ranks.control if self.ranks else None, graphs and not self.ranks)
        except BaseException:
            self.shutdown()
            raise
        if device.type == "cpu":
            cpu.available()     # kestrel's C++ kernels (built once per machine, ~25 s on two cores): now, not a step
        self.model, self.plan, self.config, self.cache = shard.model, shard.plan, shard.model.config, shard.cache
        self.handoff_layout = shard.handoff_layout
        self.tokenizer = Tokenizer.from_folder_or_none(folder)
        if self.tokenizer is not None:
            self.eos_token_ids = self.tokenizer.eos_token_ids
        else:
            self.eos_token_ids = [] if self.config.eos_token_id is None else [self.config.eos_token_id]
        self.sampling_defaults = model_sampling_defaults(folder)
        self.grammars = (GrammarCompiler(self.tokenizer, self.config.vocab_size)
                         if self.tokenizer is not None and self.eos_token_ids else None)
        page_table = shard.page_table
        journals = [(page_table, DeviceOps())] + [        # DP attention: the other groups' tables are only recorded
            (PageTable(page_table.rows.shape[0], page_table.max_pages, 0, "meta"), DeviceOps())
            for _ in range(layout.dp_size - 1)]
        groups = [self._scheduler(table, ops) for table, ops in journals]
        self.scheduler = groups[0] if len(groups) == 1 else DPScheduler(groups)
        self.pacer = PrefillPacer(args.max_decode_stall_ms / 1000)
        slots, ops = self.plan.num_slots, journals[0][1]
        decode_graphs = None
        self.background = None
        # the KDA chunk terms compile only where kestrel's CPU kernel does not compute them (--disable-cpu-kernels)
        compiled_terms = compiled and not self.ranks and not (device.type == "cpu" and cpu.available())
        if compiled and not self.ranks:
            use_compile_cache()
            if mode == "background":
                self.background = BackgroundCompiler()
                if compiled_terms:
                    config = self.config
                    self.background.ask(PREFILL_TERMS, lambda: compile_chunk_terms(
                        "inductor", config.kda_num_heads, config.kda_head_dim, config.kda_head_dim))
        if shard.graphs:
            max_bs = min(args.torch_compile_max_bs if compiled else args.cuda_graph_max_bs,
                         self.plan.max_running_requests)
            decode_graphs = DecodeGraphs(self.model, self.cache, page_table, max_bs, scratch_slot=slots,
                                         compile="inductor" if compiled else None,
                                         max_tokens_per_seq=1 + (args.speculative_num_draft_tokens
                                                                 if args.speculative_algorithm != "none" else 0),
                                         background=self.background)
            log.info("decode: %s for batches of up to %d sequences, made on first use%s",
                     "torch.compile'd steps" if compiled else "CUDA graphs", decode_graphs.max_batch_size,
                     " (in the background: until then they run eagerly)" if self.background else "")
            if self.background is not None:
                decode_graphs.available(1, 1)           # the first graph a server needs, asked for now
        try:
            self.drafter = model_drafter(args, shard, "inductor" if mode == "foreground" and not self.ranks else None)
        except BaseException:
            self.shutdown()
            raise
        self.runner = ModelRunner(self.model, self.cache, page_table, ops, decode_graphs, self.ranks, journals[1:],
                                  prefill_compile="inductor" if compiled_terms else None,
                                  drafter=self.drafter, background=self.background, balancer=shard.balancer)
        self.requests: dict[str, Request] = {}
        self.stalled = False          # the last step found nothing to run: only a new request or an abort helps
        self._arrivals = itertools.count()
        self._compiling: dict[str, Future] = {}     # request id -> its grammar, compiling
        self._finished_on_arrival: list[Request] = []    # prefilled requests whose first token ended them
        self._handing_off: list[Sequence] = []      # PD prefill side: ended at their first token, not handed off yet
        self._recomputing: WeakKeyDictionary[Sequence, Handoff] = WeakKeyDictionary()  # prefilled, computed here
        self.spec_stats = SpecStats(args.speculative_num_draft_tokens)
        self.standalone = None
        if args.speculative_algorithm == "STANDALONE":
            self.standalone = StandaloneDrafter(shard.draft, shard.draft_cache, page_table, args.chunked_prefill_size)
        torch.manual_seed(args.random_seed)

    def _scheduler(self, page_table: PageTable, ops: DeviceOps) -> Scheduler:
        """A scheduler over new pools of the plan's sizes (one DP group's), recording into page_table and ops."""
        args, plan = self.args, self.plan
        state_pool, kv_pool = StatePool(plan.num_slots, ops), KVPool(plan.num_pages, plan.page_size, ops)
        return Scheduler(state_pool, kv_pool, page_table, plan.max_running_requests, args.chunked_prefill_size,
                         args.max_prefill_tokens, build_prefix_cache(args, state_pool, kv_pool, self.cache, plan),
                         args.mamba_scheduler_strategy == "extra_buffer", args.mamba_track_interval,
                         args.speculative_num_draft_tokens if args.speculative_algorithm != "none" else 0)

    def shutdown(self) -> None:
        """Stop the other ranks of a distributed instance (nothing to do in one process); after a failed step
        without a word (they may wait in a collective that will never complete)."""
        if getattr(self, "background", None) is not None:
            self.background.close()
        if self.ranks is not None:
            runner = getattr(self, "runner", None)        # (None while __init__ fails)
            self.ranks.stop(failed=runner is not None and runner.failure is not None)

    def rank_failure(self) -> str | None:
        """Why a distributed instance can run no more steps (a step failed, or a rank this process spawned
        exited); None while it can."""
        if self.runner.failure is not None or self.ranks is None:
            return self.runner.failure
        dead = self.ranks.dead()
        return f"the distributed instance stopped: {dead}" if dead else None

    @property
    def context_length(self) -> int:
        return self.plan.context_length

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, handoff: Callable[[Handoff], None] | None = None,
                    cache_point: int | None = None) -> None:
        """Queue a request; a ValueError (one sentence) if it can never run, before it takes any memory.

        cache_point: where the prefix cache saves the prompt's state (default: before its last token); a chat
        request's is where its messages end and the reply's opening begins, since the next turn renders this
        reply as history and shares the prompt only up to there.

        handoff (PD prefill side): the request stops at its first token, and handoff gets the state its caches hold
        then (on the engine thread, before its memory is freed)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use.")
        if handoff is not None:
            self._check_handoff(params)
        if params.structured_outputs is not None and self.grammars is None:
            raise ValueError(f"structured outputs need the model's tokenizer (tokenizer.json or tiktoken.model) with "
                             f"an end-of-sequence token, which {self.args.model} lacks.")
        ids = self._prompt_ids(prompt)
        self._check_fits(ids, params)
        room = self.context_length - len(ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens, which leaves no room in the context length of "
                             f"{self.context_length} tokens.")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                             f"context length of {self.context_length} tokens.")
        request = Request(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                          next(self._arrivals), priority)
        request.handoff = handoff
        request.cache_point = min(max(cache_point, 0), len(ids) - 1) if cache_point is not None else len(ids) - 1
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self.requests[request_id] = request
        seq = self._new_sequence(request)
        if params.structured_outputs is None:
            self.scheduler.add(seq)
        else:
            self._compiling[request_id] = self.grammars.submit(params.structured_outputs)

    def add_prefilled_request(self, request_id: str, handoff: Handoff, params: SamplingParams | None = None,
                              priority: int = 0) -> None:
        """PD decode side: continue a request whose prompt a prefill instance computed, from the state in handoff
        (its first output token is handoff.first_token), once the pools have room (and its grammar is compiled,
        with structured outputs). A ValueError (one sentence) if it can never run here or the state does not fit
        this engine's caches."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use.")
        self._check_handoff(params)
        if params.prompt_logprobs is not None and handoff.prompt_logprobs is None:
            raise ValueError("the request asks for prompt logprobs, but the prefill instance sent none.")
        if params.logprobs is not None and handoff.first_logprobs is None:
            raise ValueError("the request asks for logprobs, but the prefill instance sent none for its first token.")
        if params.structured_outputs is not None and self.grammars is None:
            raise ValueError(f"structured outputs need the model's tokenizer (tokenizer.json or tiktoken.model) with "
                             f"an end-of-sequence token, which {self.args.model} lacks.")
        ids = self._prompt_ids(handoff.prompt_ids)
        self._check_fits(ids, params)
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.context_length:
            raise ValueError(f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                             f"context length of {self.context_length} tokens.")
        tensors = self._loadable(handoff, self.scheduler.kv_pool.pages_for(len(ids)))
        request = Request(request_id, None, ids, params, next(self._arrivals), priority)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = list(handoff.prompt_logprobs)
        self.requests[request_id] = request
        seq = self._new_sequence(request)
        if tensors is None:
            log.info("request %s: the handoff holds no draft context for this instance's drafter; computing its "
                     "prompt here", request_id)
            self._recomputing[seq] = handoff
        else:
            seq.prefilled = replace(handoff, tensors=self.handoff_layout.entry(tensors))
        if params.structured_outputs is not None:
            self._compiling[request_id] = self.grammars.submit(params.structured_outputs)
        elif seq.prefilled is not None:
            self._arrive(seq)
        else:
            self.scheduler.add(seq)

    def _loadable(self, handoff: Handoff, pages: int) -> dict[str, torch.Tensor] | None:
        """The handoff's tensors this engine loads: the contract's (a ValueError if they do not fit its caches) and
        the draft context its drafter reads; None where the drafter needs context the handoff lacks, so that the
        prompt is computed here."""
        contract, context = split_context({name: (t.shape, t.dtype) for name, t in handoff.tensors.items()})
        wanted, wanted_context = split_context(self.handoff_layout.spec(pages))
        if handoff.num_pages != pages or contract != wanted or not 0 <= handoff.first_token < self.config.vocab_size:
            raise ValueError("the state handed over does not fit this engine's caches (another model, dtype or page "
                             "size); serve the same model at the same --dtype and --page-size on both instances.")
        if not wanted_context:
            return split_context(handoff.tensors)[0]
        return handoff.tensors if context == wanted_context else None

    def _arrive(self, seq: Sequence) -> None:
        """A prefilled sequence takes its first token, then waits for the pools; a first token that ends it finishes
        the request at once."""
        self._take_first_token(seq, seq.prefilled)
        if seq.status is Status.FINISHED:
            self._finished_on_arrival.append(seq.request)
        else:
            self.scheduler.add(seq)

    def _take_first_token(self, seq: Sequence, handoff: Handoff) -> None:
        """Append the prefill side's first token to seq, with its logprobs and a seeded generator's state after it."""
        if seq.generator is not None and handoff.generator_state is not None:   # seeded: sample on where it was
            seq.generator.set_state(handoff.generator_state)
        if seq.logprobs is not None:
            seq.logprobs.append(handoff.first_logprobs)
            seq.cumulative_logprob += handoff.first_logprobs[handoff.first_token].logprob
        self._accept(seq, handoff.first_token)

    def _check_handoff(self, params: SamplingParams) -> None:
        if len(self.scheduler.groups) > 1:
            raise ValueError("PD handoffs do not run with DP attention yet; serve this instance without "
                             "--enable-dp-attention.")
        if params.n != 1:
            raise ValueError("a request split between prefill and decode instances must have n=1.")

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        """A ValueError for a request that could never be admitted, even into an idle engine."""
        limit = self.args.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than this server's limit of {limit} "
                             "(--max-prompt-tokens).")
        running, pages = self.scheduler.max_running, self.scheduler.kv_pool.num_pages
        if params.n > running:
            raise ValueError(f"n={params.n} needs {params.n} sequences running at once, but this engine runs at most "
                             f"{running} (--max-running-requests, or the state slots of --max-mamba-cache-size).")
        if params.n > pages:
            raise ValueError(f"n={params.n} needs at least {params.n} KV pages at once, but the KV pool has "
                             f"{pages} (--max-total-tokens).")

    def abort_request(self, request_id: str, reason: str | None = None) -> RequestOutput | None:
        """Stop a request wherever it is (queued, prefilling, decoding); its memory is free on return. The
        sequences it stops finish with "abort" (and `reason`, if given, as their stop_reason)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._compiling.pop(request_id, None)
        for seq in request.sequences:
            if seq.status is not Status.FINISHED:
                seq.finish_reason, seq.stop_reason = "abort", reason
                self.scheduler.finish(seq)
        return request.output()

    def fail_running(self) -> list[str]:
        """After a step that raised outside any request's guard: abort every request with a running sequence;
        returns their ids."""
        failed = [request_id for request_id, request in self.requests.items()
                  if any(s.status is Status.RUNNING for s in request.sequences)]
        for request_id in failed:
            self.abort_request(request_id)
        return failed

    def num_running_requests(self) -> int:
        """Requests with at least one sequence holding a state slot."""
        return len({seq.request.request_id for seq in self.scheduler.running})

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of every request that produced tokens or finished (cumulative). With
        --enable-deterministic-inference, under the batch-invariant operators (kestrel.engine.deterministic)."""
        with batch_invariant.invariant() if self.args.enable_deterministic_inference else contextlib.nullcontext():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        rejected = self._schedule_compiled() + self._finished_on_arrival
        self._finished_on_arrival = []
        for request in rejected:
            self.requests.pop(request.request_id, None)
        if self.args.speculative_algorithm in ("NGRAM", "STANDALONE"):
            started = time.perf_counter()
            with module_calls() if self.background else contextlib.nullcontext():    # a STANDALONE draft model
                self._propose_drafts()
            self.spec_stats.draft_seconds += time.perf_counter() - started
        decoding = self.scheduler.decoding()
        paced = decoding and self.scheduler.prefilling()        # (the limit's fit costs ~0.1 ms: only then)
        chunks = self.scheduler.schedule(self.pacer.limit(decoding) if paced else None)
        self.stalled = not chunks and not self._compiling
        if not chunks:
            if self._compiling:
                wait(self._compiling.values(), COMPILE_POLL_S, FIRST_COMPLETED)
            return [request.output() for request in rejected]
        prompt_tokens, decoded = sum(c.length for c in chunks if not c.decodes), sum(c.decodes for c in chunks)
        computing = time.perf_counter()
        touched: dict[str, Request] = {r.request_id: r for r in rejected}
        verifying = [c for c in chunks if c.draft]
        decodes, prompts = [c for c in chunks if c.decodes and not c.draft], [c for c in chunks if not c.decodes]
        computed: list[Computed] = []     # for a model drafter (MTP, block draft)
        for plain in (decodes, prompts):  # apart: in one forward every sequence would take the prefill path
            if plain:
                self._run_plain(plain, touched, computed)
        if verifying:
            self._run_verify(verifying, touched, computed)
        if self.drafter is not None:
            started = time.perf_counter()
            self._draft_from_hidden(computed, touched)
            self.spec_stats.draft_seconds += time.perf_counter() - started
        self._hand_off_ended()
        self.pacer.observe(decoded, prompt_tokens, time.perf_counter() - computing)
        for request_id, request in touched.items():
            if request.finished:
                self.requests.pop(request_id, None)
        return [request.output() for request in touched.values()]

    def _forward(self, chunks: list[ScheduledChunk], all_rows: set[int], touched: dict[str, Request],
                 verify: bool = False) -> list[torch.Tensor | None] | None:
        """The runner's logits for chunks, or None after a failure, which fails the chunks' requests only (they
        may hold half-written caches)."""
        try:
            return self.runner.run(chunks, all_rows, verify)
        except Exception as e:
            log.exception("a model step failed")
            for request in {id(c.seq.request): c.seq.request for c in chunks}.values():
                self._fail(request, f"the model failed on a batch holding this request: {type(e).__name__}: {e}")
                touched[request.request_id] = request
            return None

    def _run_plain(self, chunks: list[ScheduledChunk], touched: dict[str, Request], computed: list[Computed]
                   ) -> None:
        """Prefill chunks and one-token decode steps: compute, then sample where a chunk reaches its end.
        computed gets each chunk's positions."""
        all_rows = {i for i, c in enumerate(chunks) if self._needs_prompt_logprobs(c)}
        logits = self._forward(chunks, all_rows, touched)
        if logits is None:
            return
        if self.drafter is not None:
            rows = itertools.accumulate([c.length for c in chunks], initial=0)
            forward = len(self.runner.kept) - 1
            computed += [Computed(c.seq, c.start, forward, first, c.length) for c, first in zip(chunks, rows)]
        to_sample: list[tuple[Sequence, torch.Tensor]] = []
        for i, (chunk, chunk_logits) in enumerate(zip(chunks, logits)):
            chunk.seq.num_computed += chunk.length
            self.scheduler.record_progress(chunk.seq)
            if i in all_rows:
                self._record_prompt_logprobs(chunk, chunk_logits)
            if chunk.samples:
                touched[chunk.seq.request.request_id] = chunk.seq.request
                handoff = self._recomputing.pop(chunk.seq, None)
                if handoff is not None:             # a prefilled prompt computed here: the prefill side's token
                    self._take_first_token(chunk.seq, handoff)
                    continue
                for seq in [chunk.seq, *self._fork(chunk.seq)]:
                    to_sample.append((seq, chunk_logits[-1]))
        if to_sample:
            self._sample_and_append(to_sample)

    def _draft_room(self, seq: Sequence) -> int:
        """How many draft tokens seq may verify next step: none before its first output token, with structured
        outputs, while it still has prompt to compute, or while more sequences run than
        --speculative-disable-by-batch-size; else as many as its max_tokens and the context leave."""
        params, n = seq.request.params, seq.num_tokens
        limit = self.args.speculative_disable_by_batch_size
        if seq.status is not Status.RUNNING or seq.num_computed != n - 1 or not seq.output_ids \
                or seq.matcher is not None or (limit is not None and len(self.scheduler.running) > limit):
            return 0
        room = min(self.args.speculative_num_draft_tokens, self.context_length - n)
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - len(seq.output_ids) - 1)
        return max(room, 0)

    def _propose_drafts(self) -> None:
        """NGRAM or STANDALONE drafts for every sequence that may speculate."""
        wanted = [(seq, self._draft_room(seq)) for seq in self.scheduler.running]
        if self.standalone is not None:
            drafts = self.standalone.draft(wanted)
        else:
            drafts = [ngram.propose(seq.tokens(max(seq.num_tokens - ngram.WINDOW, 0), seq.num_tokens), room)
                      for seq, room in wanted]
        for (seq, _), draft in zip(wanted, drafts):
            seq.draft = tuple(draft)

    def _draft_from_hidden(self, computed: list[Computed], touched: dict[str, Request]) -> None:
        """Hand the model drafter (MTP layer, block draft) the positions this step computed and kept, and take its
        drafts for the next step (on every rank; called every step, so that no rank keeps hidden states longer).
        A position's input is its hidden state and the token after it, so a chunk's last position waits for that
        token: the next prompt token, or the one just sampled. A failure fails the drafting requests."""
        inputs, owners = [], []
        for seq, start, forward, first_row, length in computed:
            if seq.status is not Status.RUNNING:
                continue
            end = min(start + length, seq.num_tokens - 1)      # positions whose next token is known
            if end <= start:
                continue
            inputs.append(DraftInput(seq.slot, start, forward, first_row, seq.tokens(start + 1, end + 1),
                                     len(seq.pages) * self.plan.page_size, self._draft_room(seq)))
            owners.append(seq)
        try:
            drafts = self.runner.draft(inputs)
        except Exception as e:
            log.exception("drafting failed")
            for seq in owners:
                self._fail(seq.request, f"drafting failed: {type(e).__name__}: {e}")
                touched[seq.request.request_id] = seq.request
            return
        for seq, draft in zip(owners, drafts):
            seq.draft = tuple(draft)

    def _run_verify(self, chunks: list[ScheduledChunk], touched: dict[str, Request], computed: list[Computed]
                    ) -> None:
        """Verify every chunk's draft in one forward, then per sequence: emit the accepted tokens, commit the KDA
        state after the last token computed and accepted, release the pages past what the next verification
        needs. computed gets each sequence's kept positions (the last accepted one's included)."""
        started = time.perf_counter()
        logits = self._forward(chunks, set(range(len(chunks))), touched, verify=True)
        self.spec_stats.verify_seconds += time.perf_counter() - started
        if logits is None:
            return
        forward = len(self.runner.kept) - 1
        first = 0
        for chunk, chunk_logits in zip(chunks, logits):
            seq, draft = chunk.seq, list(chunk.draft)
            touched[seq.request.request_id] = seq.request
            start, first = first, first + chunk.length
            if not finite_rows(chunk_logits).all():
                self._fail(seq.request, "the model produced NaN or infinite logits for this request.")
                continue
            try:
                tokens = verify(chunk_logits, draft, self._sampling_row(seq))
                accepted = len(tokens) - 1
                self.spec_stats.record(len(draft), accepted)
                seq.num_computed += 1 + accepted
                self.runner.ops.keep_token_states([start + accepted], [seq.slot])
                if self.drafter is not None:
                    computed.append(Computed(seq, chunk.start, forward, start, accepted + 1))
                result = None if seq.logprobs is None else gather_logprobs(
                    raw_logprobs(chunk_logits[:len(tokens)]), torch.tensor(tokens), seq.request.params.logprobs or 0)
                for i, token in enumerate(tokens):
                    if seq.status is Status.FINISHED:
                        break
                    self._append(seq, token, result, i)
            except Exception as e:
                log.exception("request %s failed", seq.request.request_id)
                self._fail(seq.request, f"{type(e).__name__}: {e}")
                continue
            if seq.status is Status.RUNNING:
                self.scheduler.release_beyond(seq)
                self.scheduler.record_progress(seq)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.args.model} has no tokenizer.json or tiktoken.model, so prompts must be "
                                 "token ids.")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty.")
        vocab = self.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}).")
        return ids

    def _new_sequence(self, request: Request) -> Sequence:
        index = len(request.sequences)
        params = request.params
        generator = new_generator(params.seed + index, self.runner.device) if params.seed is not None else None
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_ids, params.skip_special_tokens,
                                                 params.stop, params.include_stop_str_in_output)
        seq = Sequence(request, index, generator, detokenizer)
        if request.grammar is not None:
            seq.matcher = request.grammar.matcher()
        if params.logprobs is not None:
            seq.logprobs = []
        request.sequences.append(seq)
        return seq

    def _schedule_compiled(self) -> list[Request]:
        """Hand the requests whose grammar is ready to the scheduler; fail those whose grammar failed (returned)."""
        rejected = []
        for request_id, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            request = self.requests[request_id]
            try:
                request.grammar = future.result()
            except Exception as e:      # a ValueError for a bad constraint; the request fails, the engine goes on
                self._fail(request, str(e))
                self.requests.pop(request_id)
                rejected.append(request)
                continue
            for seq in request.sequences:
                seq.matcher = request.grammar.matcher()
                if seq.prefilled is not None:
                    self._arrive(seq)
                else:
                    self.scheduler.add(seq)
        return rejected

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The n-1 sibling sequences of an n > 1 request, started from seq's state once its prompt is done."""
        children = []
        for _ in range(seq.forks_pending):
            child = self._new_sequence(seq.request)
            self.scheduler.fork(seq, child)
            children.append(child)
        return [c for c in children if c.status is Status.RUNNING]

    def _sample_and_append(self, targets: list[tuple[Sequence, torch.Tensor]]) -> None:
        """Sample every target's next token and append it. A failure (non-finite logits, a sampler error, a
        detokenizer error) fails only the request it belongs to."""
        logits = torch.stack([row_logits for _, row_logits in targets])
        finite = finite_rows(logits).tolist()
        for (seq, _), ok in zip(targets, finite):
            if not ok:
                self._fail(seq.request, "the model produced NaN or infinite logits for this request.")
        kept = [i for i, (seq, _) in enumerate(targets) if seq.status is not Status.FINISHED]
        if not kept:
            return
        seqs = [targets[i][0] for i in kept]
        rows = [self._sampling_row(s) for s in seqs]
        try:
            batch = sample(logits if len(kept) == len(targets) else logits[kept], rows)    # (no copy when all kept)
            results = [(seq, batch, i) for i, seq in enumerate(seqs)]
        except Exception:   # find the row that fails: every other row is sampled on its own
            log.exception("batched sampling failed; sampling row by row")
            results = []
            for i, seq in enumerate(seqs):
                try:
                    results.append((seq, sample(logits[kept[i]:kept[i] + 1], rows[i:i + 1]), 0))
                except Exception as e:
                    self._fail(seq.request, f"sampling failed: {type(e).__name__}: {e}")
        for seq, result, row in results:
            if seq.status is Status.FINISHED:      # a sibling failed the request
                continue
            try:
                self._append(seq, int(result.token_ids[row]), result, row)
            except Exception as e:
                log.exception("request %s failed", seq.request.request_id)
                self._fail(seq.request, f"{type(e).__name__}: {e}")

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        bitmask = seq.matcher.bitmask() if seq.matcher is not None else None
        return SamplingRow(seq.request.params, seq.request.prompt_ids, seq.output_ids, seq.generator,
                           self.eos_token_ids, bitmask)

    def _fail(self, request: Request, message: str) -> None:
        """End every unfinished sequence of request with finish_reason "error" and `message`."""
        log.error("request %s failed: %s", request.request_id, message)
        for seq in request.sequences:
            if seq.status is not Status.FINISHED:
                seq.finish_reason, seq.stop_reason = "error", message
                self.scheduler.finish(seq)

    def _append(self, seq: Sequence, token: int, result: SampleResult | None, row: int) -> None:
        """Append token, with row `row` of result as its logprobs where seq reports them (result is None where not)."""
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(result, row, seq.request.params.logprobs))
            seq.cumulative_logprob += float(result.logprobs[row])
        self._accept(seq, token)

    def _accept(self, seq: Sequence, token: int) -> None:
        """Append token to seq's output and finish seq where it stops (a PD prefill side's after one token)."""
        params = seq.request.params
        seq.output_ids.append(token)
        if seq.matcher is not None:
            seq.matcher.advance(token)
        detokenizer = seq.detokenizer
        if token in params.stop_token_ids:
            self._finish(seq, "stop", token)
        elif token in self.eos_token_ids and not params.ignore_eos:
            self._finish(seq, "stop", None)
        else:
            if detokenizer is not None:
                detokenizer.add(token)
                seq.text = detokenizer.text
            if detokenizer is not None and detokenizer.stop_string is not None:
                self._finish(seq, "stop", detokenizer.stop_string)
            elif (params.max_tokens is not None and len(seq.output_ids) >= params.max_tokens) \
                    or seq.num_tokens >= self.context_length or seq.request.handoff is not None:
                self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        if seq.detokenizer is not None:
            seq.detokenizer.finish()
            seq.text = seq.detokenizer.text
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.request.handoff is not None:     # read once this step's drafting wrote the last prompt position
            self._handing_off.append(seq)
            return
        self.scheduler.finish(seq)

    def _hand_off_ended(self) -> None:
        """Hand off the sequences that ended at their first token this step (unless drafting failed them since),
        then free their memory."""
        for seq in self._handing_off:
            if seq.status is not Status.RUNNING:
                continue
            try:
                self._hand_off(seq)
            except Exception as e:
                log.exception("request %s failed", seq.request.request_id)
                self._fail(seq.request, f"the handoff failed: {type(e).__name__}: {e}")
                continue
            self.scheduler.finish(seq)
        self._handing_off = []

    def _hand_off(self, seq: Sequence) -> None:
        """Read seq's state and prompt pages (after every cache write journaled before) for its handoff, in one
        process's layout (gathered from every rank of a distributed instance)."""
        request, pages = seq.request, seq.pages[:self.scheduler.kv_pool.pages_for(seq.num_computed)]
        tensors = self.handoff_layout.named(self.runner.save(handoff_parts(seq.slot, pages)))
        request.handoff(Handoff(request.prompt_ids, seq.output_ids[0], tensors, len(pages),
                                seq.logprobs[0] if seq.logprobs else None,
                                seq.generator.get_state() if seq.generator is not None else None,
                                request.prompt_logprobs))

    def _logprob_entry(self, result: SampleResult, row: int, num_top: int) -> TokenLogprobs:
        """The chosen token's raw logprob and rank, plus the top num_top alternatives."""
        entry = {int(result.token_ids[row]): Logprob(float(result.logprobs[row]), int(result.ranks[row]),
                                                     self._token_text(int(result.token_ids[row])))}
        for rank, (token, logprob) in enumerate(zip(result.top_ids[row, :num_top].tolist(),
                                                    result.top_logprobs[row, :num_top].tolist()), 1):
            entry.setdefault(token, Logprob(logprob, rank, self._token_text(token)))
        return entry

    def _token_text(self, token: int) -> str | None:
        return self.tokenizer.token_text(token) if self.tokenizer is not None else None

    def _needs_prompt_logprobs(self, chunk: ScheduledChunk) -> bool:
        request = chunk.seq.request
        recorded = request.prompt_logprobs
        return (recorded is not None and chunk.seq.index == 0 and len(recorded) < len(request.prompt_ids)
                and chunk.start < len(request.prompt_ids))

    def _record_prompt_logprobs(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Logprobs of prompt token p+1 from the logits at position p, for positions not recorded before."""
        request = chunk.seq.request
        prompt, recorded = request.prompt_ids, request.prompt_logprobs
        first = max(chunk.start, len(recorded) - 1)                 # position whose logits predict the next entry
        last = min(chunk.start + chunk.length, len(prompt) - 1)       # one past the last such position
        if first >= last:
            return
        targets = torch.tensor(prompt[first + 1:last + 1], device=logits.device)
        rows = logits[first - chunk.start:last - chunk.start]
        result = gather_logprobs(raw_logprobs(rows), targets, request.params.prompt_logprobs)
        for row in range(last - first):
            recorded.append(self._logprob_entry(result, row, request.params.prompt_logprobs))
