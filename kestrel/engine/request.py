"""Requests and their sequences as the engine tracks them: tokens, cache holdings, progress, results."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cache.radix import Node
from .handoff import Handoff
from .outputs import CompletionOutput, RequestOutput, TokenLogprobs
from .sampling import SamplingParams
from .structured import CompiledGrammar, GrammarMatcher
from .tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to be recomputed
    RUNNING = "running"      # holds a state slot and KV pages
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A prompt and its n continuations. The first sequence prefills the prompt; the other n-1 fork from it."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int                      # admission order among equal priorities
    priority: int = 0                 # lower runs first
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    grammar: CompiledGrammar | None = None      # params.structured_outputs, once compiled
    num_cached_tokens: int | None = None        # prompt tokens served from the prefix cache, once admitted
    handoff: Callable[[Handoff], None] | None = None    # PD prefill side: gets the state after the first token
    cache_point: int = 0                        # prefix cache: the prompt position whose state is saved

    @property
    def finished(self) -> bool:
        """Every continuation is done (an abort or a failure also ends those not yet forked)."""
        done = all(s.status is Status.FINISHED for s in self.sequences)
        ended = any(s.finish_reason in ("abort", "error") for s in self.sequences)
        return done and (len(self.sequences) == self.params.n or ended)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
            prompt_logprobs=self.prompt_logprobs, outputs=[s.output() for s in self.sequences],
            finished=self.finished, num_cached_tokens=self.num_cached_tokens or 0)


@dataclass(eq=False)
class Sequence:
    """One continuation. Its tokens are the prompt then output_ids; the first num_computed are in its caches."""

    request: Request
    index: int
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    reserved_slots: list[int] = field(default_factory=list)   # slots held for the n-1 sequences still to fork
    num_computed: int = 0
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    matcher: GrammarMatcher | None = None                      # where the output stands in request.grammar
    cache_node: Node | None = None        # prefix cache: the node of its last page in the tree (it holds a lock)
    cached_pages: int = 0                 # its first cached_pages pages are in the tree
    last_snapshot: int = 0                # tokens computed at its last state snapshot
    capture_slot: int | None = None       # the slot its running step saves its cache point's state into
    prefilled: Handoff | None = None      # PD decode side: the prompt's state, loaded when it is admitted
    draft: tuple[int, ...] = ()           # speculative tokens proposed for its next step
    dp_group: int = 0                     # DP attention: the DP group whose pools hold it (DPScheduler)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions start..end-1 of prompt + output."""
        prompt = self.request.prompt_ids
        if start >= len(prompt):
            return self.output_ids[start - len(prompt):end - len(prompt)]
        return prompt[start:end] + self.output_ids[:max(end - len(prompt), 0)]

    @property
    def priority_key(self) -> tuple[int, int, int]:
        return self.request.priority, self.request.arrival, self.index

    @property
    def forks_pending(self) -> int:
        """Sequences of this request still to fork from this one (only the first sequence, before its first token)."""
        request = self.request
        return request.params.n - len(request.sequences) if self.index == 0 else 0

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(self.output_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs, finish_reason=self.finish_reason, stop_reason=self.stop_reason)
