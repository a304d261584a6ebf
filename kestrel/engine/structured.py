"""Structured outputs: a constraint (a JSON schema, any JSON object, a regular expression, an EBNF grammar or a
choice of strings) compiled once, then one matcher per sequence that says which tokens may come next.

The grammar engine is llguidance (vLLM's "guidance" backend), chosen over xgrammar by measurement
(benchmarks/bench_structured.py, section "structured" of docs/benchmarks.md: one JSON-object constraint over a
200-token JSON document, one thread of this 2-core CPU). Per-token mask at K3's 163,840-token vocabulary:
llguidance 0.07 ms, xgrammar 0.01 ms, the hand-written byte automaton it replaces 223 ms (it walked the vocabulary
in Python for every new state), so both engines are far below a decode step; at 4,096: 0.018, 0.006 and 4.3 ms.
A new grammar costs llguidance about 2 ms (its lexer is built lazily, as tokens arrive) where xgrammar compiles
78 ms up front at 163,840 (5 ms at 4,096), and a request waits for that. llguidance is one 8 MB wheel with no
dependencies; xgrammar requires transformers and triton at run time (about 1.1 GB installed, triton 1 GB of it)
plus apache-tvm-ffi. The mask difference is invisible next to a K3 forward; the compile and dependency weight
are not, so llguidance.

How it runs:
- `StructuredOutputsParams` is the constraint as a request states it (vLLM's fields); `key` identifies it.
- `GrammarCompiler` holds the vocabulary as llguidance sees it (built on first use: text tokens as their bytes,
  added tokens as special tokens that only a grammar naming them, `<[id]>` or `<|name|>`, lets through) and an
  LRU cache of compiled grammars keyed by the constraint. `submit` compiles on a worker thread and returns a
  Future (done at once on a cache hit; one compile per constraint in flight); `compile` waits for it. The server
  compiles at admission in a worker thread, so a bad constraint is a 400 before the engine sees the request; the
  engine calls `submit` and keeps a request out of the scheduler until its grammar is ready, so the engine loop
  never waits on a compile.
- `CompiledGrammar.matcher()` copies the compiled grammar into a `GrammarMatcher` for one sequence (cheap).
- `GrammarMatcher.bitmask()` is the next-token mask, [W] int32 with W = ceil(V / 32): bit t % 32 of word t // 32
  is set where token t may come next; end-of-sequence tokens only where the grammar accepts the text.
  `advance(token)` consumes the sampled token. `apply_token_bitmasks` puts the masks on the logits' device.

JSON (json_object and json schemas): RFC 8259 without whitespace between items (`,` and `:` alone, as xgrammar's
`any_whitespace=False` and llguidance's non-flexible whitespace write it), since a small model given free whitespace
fills it up to max_tokens; `disable_any_whitespace=False` (vLLM's option, and vLLM's default) allows any whitespace
between items, at most MAX_SPACE characters in a row. `\\uXXXX` escapes for any code point; strings hold any
character raw but DEL (U+007F, which llguidance wants escaped); the text starts with the value itself.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

from .tokenizer import Tokenizer

MAX_SPACE = 20
SPECIAL_MARKER = b"\xff"      # how llguidance marks a special token's bytes (never valid UTF-8)
FLEXIBLE_JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_SPACE}}}",
                         "json_allow_general_unicode_escapes": True}
COMPACT_JSON_OPTIONS = {"whitespace_flexible": False, "json_allow_general_unicode_escapes": True}
_KINDS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regular expression", "grammar": "grammar",
          "choice": "choice"}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's StructuredOutputsParams); exactly one field is set.

    json: a JSON schema (an object, or its JSON text); json_object: any JSON object; regex: a regular expression
    the whole output matches (Rust regex syntax, as vLLM's guidance backend); grammar: an EBNF grammar, in GBNF
    (`root ::= ...`, llama.cpp's and SGLang's) or Lark syntax; choice: strings the whole output is exactly one of
    (kept as a tuple). disable_any_whitespace: JSON without whitespace between items (the default here, unlike
    vLLM); False allows up to MAX_SPACE whitespace characters per gap.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool | None = None
    choice: Sequence[str] | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, regex, grammar, json_object or choice, "
                             f"got {', '.join(given) or 'none'}.")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON ({e}).") from None
        checks = {"json": dict, "regex": str, "grammar": str, "json_object": bool}
        value = getattr(self, given[0])
        if given[0] == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(text, str) for text in value):
                raise ValueError("structured outputs' choice must be a list of at least one string.")
            object.__setattr__(self, "choice", tuple(value))
        elif not isinstance(value, checks[given[0]]):
            allowed = "a JSON object" if given[0] == "json" else checks[given[0]].__name__
            raise ValueError(f"structured outputs' {given[0]} must be {allowed}, got {type(value).__name__}.")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured outputs' disable_any_whitespace must be true or false, got "
                             f"{self.disable_any_whitespace!r}.")

    @property
    def kind(self) -> str:
        """Which field is set: "json", "regex", "grammar", "json_object" or "choice"."""
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, compact): equal for constraints that compile to the same grammar."""
        value = getattr(self, self.kind)
        text = json.dumps(value, sort_keys=True) if self.kind in ("json", "choice") else str(value)
        return self.kind, text, self.disable_any_whitespace and self.kind in ("json", "json_object")


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocabulary: _Vocabulary):
        self._matcher = matcher
        self._vocabulary = vocabulary

    @property
    def accepting(self) -> bool:
        """The text so far is a whole match (end-of-sequence is allowed)."""
        return self._matcher.is_accepting()

    def bitmask(self) -> torch.Tensor:
        """[W] int32, W = ceil(V / 32): bit t % 32 of word t // 32 is set where token t may come next."""
        words = np.empty(self._vocabulary.words, dtype=np.uint32)
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        eos = self._vocabulary.eos_ids[0]
        if words[eos >> 5] >> (eos & 31) & 1:
            for token in self._vocabulary.eos_ids[1:]:
                words[token >> 5] |= np.uint32(1 << (token & 31))
        return torch.from_numpy(words.view(np.int32))

    def advance(self, token: int) -> None:
        """Consume the sampled token; a ValueError if the grammar did not allow it. Once the grammar has ended
        (only end-of-sequence can follow), further tokens are ignored."""
        if self._matcher.is_stopped():
            return
        if token in self._vocabulary.eos_ids:
            token = self._vocabulary.eos_ids[0]
        if not self._matcher.consume_token(token):
            raise ValueError(f"the output constraint does not allow token {token} here "
                             f"({_first_line(self._matcher.get_error())}).")


class CompiledGrammar:
    """A constraint compiled for one vocabulary; `matcher()` starts a sequence on it."""

    def __init__(self, template: llguidance.LLMatcher, vocabulary: _Vocabulary):
        self._template = template          # never advanced: each sequence gets a copy
        self._vocabulary = vocabulary

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._vocabulary)


@dataclass(frozen=True)
class _Vocabulary:
    """The vocabulary as llguidance sees it, and what the masks need to know about it."""

    tokenizer: llguidance.LLTokenizer
    size: int                  # V: one more than the highest token id the model can produce
    eos_ids: tuple[int, ...]   # the first is llguidance's end-of-sequence token

    @property
    def words(self) -> int:
        return (self.size + 31) // 32


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary, on worker threads, with an LRU cache of the results."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256, threads: int = 2):
        if not tokenizer.eos_token_ids:
            raise ValueError("structured outputs need an end-of-sequence token; name one in tokenizer_config.json "
                             "or generation_config.json.")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str, bool], CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple[str, str, bool], Future] = {}
        self._lock = threading.Lock()
        self._vocabulary: _Vocabulary | None = None
        self._vocabulary_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kestrel-grammar")

    def submit(self, constraint: StructuredOutputsParams) -> Future:
        """A Future of the CompiledGrammar (its exception: a ValueError of one sentence for a bad constraint)."""
        key = constraint.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(compiled)
                return done
            if key not in self._pending:
                self._pending[key] = self._pool.submit(self._compile_and_keep, constraint)
            return self._pending[key]

    def compile(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar, waiting for it; a ValueError of one sentence for a bad constraint."""
        return self.submit(constraint).result()

    def cached(self) -> int:
        """How many compiled grammars the cache holds."""
        return len(self._cache)

    def _compile_and_keep(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        key = constraint.key
        try:
            compiled = _compile(constraint, self.vocabulary())
            with self._lock:
                self._cache[key] = compiled
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return compiled
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def vocabulary(self) -> _Vocabulary:
        """The vocabulary for llguidance, built once (0.7-1.4 s at 163,840 tokens on this CPU)."""
        with self._vocabulary_lock:
            if self._vocabulary is None:
                self._vocabulary = _build_vocabulary(self._tokenizer, self._vocab_size)
            return self._vocabulary


def apply_token_bitmasks(logits: torch.Tensor, rows: Sequence[int], bitmasks: Sequence[torch.Tensor]) -> None:
    """In place on logits [R, V]: -inf on each listed row wherever its bitmask ([W] int32, W >= V / 32) has no bit.

    The masks are unpacked on the logits' device.
    """
    if not rows:
        return
    device, vocab_size = logits.device, logits.shape[1]
    words = torch.stack(list(bitmasks)).to(device, non_blocking=True)                  # [M, W]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab_size]   # [M, V]
    index = torch.tensor(list(rows), dtype=torch.int64, device=device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _build_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> _Vocabulary:
    """Every id below vocab_size as bytes: text tokens as the text they add, added tokens as special tokens
    (SPECIAL_MARKER + their name), ids the tokenizer lacks as empty (never allowed)."""
    tokens: list[bytes] = []
    for token in range(vocab_size):
        if token in tokenizer.added_ids:
            tokens.append(SPECIAL_MARKER + tokenizer.token_text(token).encode())
        else:
            tokens.append(tokenizer.token_bytes(token) or b"")
    eos_ids = tuple(t for t in tokenizer.eos_token_ids if t < vocab_size)
    wrapper = llguidance.TokenizerWrapper(_TokenizerView(tokenizer, tokens, eos_ids[0]))
    return _Vocabulary(llguidance.LLTokenizer(wrapper), vocab_size, eos_ids)


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads from a tokenizer: the token bytes, ids, and an encoder of text."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], eos_id: int):
        self._tokenizer = tokenizer
        self.tokens = tokens
        self.eos_token_id = eos_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(t for t in tokenizer.added_ids if t < len(tokens))

    def __call__(self, data: bytes) -> list[int]:
        text = data.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False, allow_special=False)


def _compile(constraint: StructuredOutputsParams, vocabulary: _Vocabulary) -> CompiledGrammar:
    """A ValueError of one sentence when the constraint is not a valid one of its kind."""
    name = _KINDS[constraint.kind]
    options = COMPACT_JSON_OPTIONS if constraint.disable_any_whitespace else FLEXIBLE_JSON_OPTIONS
    try:
        if constraint.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        elif constraint.kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(constraint.json, defaults=options)
        elif constraint.kind == "regex":
            grammar = llguidance.grammar_from("regex", constraint.regex)
        elif constraint.kind == "choice":        # a Lark alternation of the strings as JSON literals
            grammar = llguidance.grammar_from("choice", list(constraint.choice))
        else:
            grammar = llguidance.grammar_from("grammar", constraint.grammar)
    except ValueError as e:
        raise ValueError(f"the {name} cannot be compiled ({_first_line(str(e))}).") from None
    template = llguidance.LLMatcher(vocabulary.tokenizer, grammar, log_level=0)
    if template.is_error():
        raise ValueError(f"the {name} cannot be compiled ({_first_line(template.get_error())}).")
    return CompiledGrammar(template, vocabulary)


def _first_line(message: str) -> str:
    line = next((line.strip() for line in message.splitlines() if line.strip()), "no detail")
    return line.rstrip(":.")
