"""The sampling step: per-request parameters, and a batch of logits turned into next tokens and logprobs.

`SamplingParams` keeps vLLM's field names and semantics. `sample` follows vLLM v1's order: stop tokens
masked until `min_tokens` (and tokens a structured-output constraint forbids), then penalties (repetition on prompt+output, then frequency and presence on
the output), then greedy argmax, or temperature, min_p, top_k and top_p and a draw. top_k and top_p look for
the tokens they keep among a row's TOP_CANDIDATES largest logits (a partial top-k), sorting the whole row only
where those cannot hold them. A draw is an inverse transform: one uniform u per row, and the first token whose
cumulative probability (float64) exceeds u; each seeded row draws its u from its own `torch.Generator`, so its
tokens do not depend on the rest of the batch; unseeded rows share the default generator and greedy rows draw
nothing. Reported logprobs are raw, log_softmax of the model's logits before any of these steps, and computed only
for the rows whose request asks for them (over a vocabulary of 163,840 they cost more than the argmax).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .structured import StructuredOutputsParams, apply_token_bitmasks
from .tokenizer import GENERATION_CONFIG_FILE, load_json_object

GREEDY_EPS = 1e-5
"""Temperatures below this mean greedy decoding (vLLM's threshold)."""

TOP_CANDIDATES = 1024
"""How many of a row's largest logits top_k and top_p look among first. A partial top-k instead of a sort of the whole
vocabulary: on the CPU (2 threads) 32 rows of K3's 163,840 logits take 10.6 ms against 182 for the sort."""
DRAW_BLOCK = 1024
"""Tokens per block of a draw's two-level search: a float64 cumulative sum over the whole vocabulary cost 33 ms for
32 rows of K3's 163,840 (one thread), the block sums and one block's sum 1."""
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The sampling fields a model's generation_config.json may set as defaults (vLLM's `--generation-config auto`)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}.")


def model_sampling_defaults(folder: str | Path) -> dict[str, float]:
    """{field: value} for the MODEL_DEFAULT_FIELDS that the folder's generation_config.json sets ({} without one).

    Servers use them for requests that leave those fields out, as vLLM and SGLang do; explicit values win.
    """
    path = Path(folder) / GENERATION_CONFIG_FILE
    config = load_json_object(path)
    defaults = {name: config[name] for name in MODEL_DEFAULT_FIELDS if config.get(name) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request (vLLM's fields and defaults)."""

    n: int = 1
    temperature: float = 1.0          # below 1e-5: greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # on prompt and output tokens: logit > 0 -> logit / p, else logit * p
    presence_penalty: float = 0.0     # on output tokens: logit -= p if the token occurred
    frequency_penalty: float = 0.0    # on output tokens: logit -= p * count
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None       # alternatives reported besides the chosen token (0: chosen only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    json_object: bool = False         # shorthand for structured_outputs=StructuredOutputsParams(json_object=True)
    structured_outputs: StructuredOutputsParams | None = None     # what the output must match (vLLM's field)

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_penalties()
        self._check_stopping()
        self._check_output()

    def _check_sampling(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _require(_is_real(self.temperature) and self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and self.top_k >= -1, "top_k",
                 "an integer >= 1, or 0 or -1 to disable it", self.top_k)
        _require(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(self.seed is None or (_is_int(self.seed) and _SEED_MIN <= self.seed <= _SEED_MAX), "seed",
                 "null or an integer in [-2**63, 2**64 - 1]", self.seed)
        self.temperature, self.top_p, self.min_p = float(self.temperature), float(self.top_p), float(self.min_p)
        self.top_k = max(self.top_k, 0)

    def _check_penalties(self) -> None:
        _require(_is_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 "> 0", self.repetition_penalty)
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            _require(_is_real(value) and -2 <= value <= 2, field, "in [-2, 2]", value)
            setattr(self, field, float(value))
        self.repetition_penalty = float(self.repetition_penalty)

    def _check_stopping(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        _require(stop is None or (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)),
                 "stop", "a non-empty string or a list of non-empty strings", self.stop)
        self.stop = list(stop or [])
        ids = self.stop_token_ids
        _require(ids is None or (isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids)),
                 "stop_token_ids", "a list of token ids (integers >= 0)", ids)
        self.stop_token_ids = list(ids or [])
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
                 "null or an integer >= 1", self.max_tokens)
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0", self.min_tokens)
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"<= max_tokens ({self.max_tokens})", self.min_tokens)

    def _check_output(self) -> None:
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            _require(value is None or (_is_int(value) and value >= 0), field, "null or an integer >= 0", value)
        for field in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "json_object"):
            _require(isinstance(getattr(self, field), bool), field, "true or false", getattr(self, field))
        _require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                 "structured_outputs", "null or a StructuredOutputsParams", self.structured_outputs)
        if self.json_object:
            _require(self.structured_outputs in (None, StructuredOutputsParams(json_object=True)), "json_object",
                     "false when structured_outputs is set", self.json_object)
            self.structured_outputs = StructuredOutputsParams(json_object=True)

    @property
    def greedy(self) -> bool:
        """True when the temperature is (near) zero: the argmax token is taken and no randomness is drawn."""
        return self.temperature < GREEDY_EPS

    @property
    def penalised(self) -> bool:
        """True when any of the repetition, presence or frequency penalties changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None       # per-request generator when params.seed is set
    eos_token_ids: Sequence[int] = ()       # blocked with params.stop_token_ids until min_tokens (unless ignore_eos)
    token_bitmask: torch.Tensor | None = None    # [ceil(V/32)] int32: bit t%32 of word t//32 set where token t may
                                                 # come next (structured outputs), on the CPU


@dataclass
class SampleResult:
    """Chosen tokens with their raw logprobs, ranks and the top-N raw alternatives per row."""

    token_ids: torch.Tensor         # [R] int64
    logprobs: torch.Tensor          # [R] fp32, raw logprob of the chosen token (NaN where not asked for)
    ranks: torch.Tensor             # [R] int64, 1-based rank of the chosen token under the raw logprobs (0: not asked)
    top_ids: torch.Tensor           # [R, N] int64, N = max requested logprobs in the batch
    top_logprobs: torch.Tensor      # [R, N] fp32


def new_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` (the logits' device) seeded with `seed` modulo 2**64 (as torch reads a negative
    seed), for one seeded sequence; it advances with each draw."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % 2**64)
    return generator


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...] bool: whether every value of the row is finite, from its max and min (NaN reaches
    both, +inf the max, -inf the min). The same as isfinite().all(-1), which allocates a mask of the logits' size:
    on the CPU, 32 rows of K3's 163,840 logits take 0.8 ms instead of 6.1 (2 threads)."""
    return logits.amax(-1).isfinite() & logits.amin(-1).isfinite()


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> log_softmax over V in fp32 [..., V]: what `logprobs` and `prompt_logprobs` report."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> SampleResult:
    """logprobs [T, V] fp32, token_ids [T] int64 -> each token's logprob and rank, and the top `num_top`.

    The rank is the number of tokens whose logprob is >= the token's own, so ties count against it (as in
    vLLM). Serves prompt logprobs too: pass raw_logprobs of the prompt logits and the prompt's next tokens.
    """
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    # counted in float32 (exact below 2**24 tokens): 3.5x faster than summing the bools on the CPU
    ranks = (logprobs >= chosen[:, None]).float().sum(dim=-1).long()
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return SampleResult(token_ids, chosen, ranks, top_ids, top_logprobs)


def _token_counts(sequences: list[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each sequence: [S, V] fp32, by one scatter_add."""
    counts = torch.zeros(len(sequences) * vocab_size, device=device)
    flat = [row * vocab_size + token for row, seq in enumerate(sequences) for token in seq]
    index = torch.tensor(flat, dtype=torch.int64, device=device)
    counts.scatter_add_(0, index, torch.ones(len(flat), device=device))
    return counts.view(len(sequences), vocab_size)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row scalars as an fp32 column [S, 1] that broadcasts over the vocabulary."""
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def mask_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits [R, V] -> logits with -inf on each row's stop tokens (and EOS unless ignore_eos) until min_tokens: a
    copy where any token is masked, else logits themselves."""
    pairs = []
    for i, row in enumerate(rows):
        if len(row.output_ids) < row.params.min_tokens:
            stops = list(row.params.stop_token_ids) + ([] if row.params.ignore_eos else list(row.eos_token_ids))
            pairs += [(i, token) for token in stops if token < logits.shape[1]]
    if not pairs:
        return logits
    index = torch.tensor(pairs, dtype=torch.int64, device=logits.device)
    logits = logits.clone()
    logits[index[:, 0], index[:, 1]] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits [R, V] fp32 -> penalised logits [R, V]: repetition on prompt+output tokens, then frequency and
    presence on output tokens. Every row gets its own penalties; rows without any are left as they are."""
    picked = [i for i, row in enumerate(rows) if row.params.penalised]
    if not picked:
        return logits
    vocab_size, device = logits.shape[1], logits.device
    sub = [rows[i] for i in picked]
    index = torch.tensor(picked, dtype=torch.int64, device=device)
    x = logits[index]
    out_counts = _token_counts([row.output_ids for row in sub], vocab_size, device)
    seen = (_token_counts([row.prompt_ids for row in sub], vocab_size, device) > 0) | (out_counts > 0)
    rep = _column([row.params.repetition_penalty for row in sub], device)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - _column([row.params.frequency_penalty for row in sub], device) * out_counts
    x = x - _column([row.params.presence_penalty for row in sub], device) * (out_counts > 0).float()
    logits = logits.clone()
    logits[index] = x
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [S, V], min_p [S, 1] -> logits with -inf where prob < min_p * the row's max prob."""
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p_drop: torch.Tensor) -> torch.Tensor:
    """logits [S, V]; top_k [S] int64 in 1..V; top_p_drop [S, 1] fp32 = 1 - top_p -> truncated logits [S, V].

    top_k keeps tokens >= the k-th largest logit (ties at the edge stay); top_p then keeps the smallest set of most
    likely tokens whose renormalised mass reaches top_p, i.e. drops each token whose ascending cumulative prob is
    <= 1 - top_p, always keeping the most likely one. Each row is decided among its TOP_CANDIDATES largest logits
    where they hold every token it keeps; the other rows (a larger top_k, a tie at the candidates' edge, a nucleus
    reaching past them) are sorted whole.
    """
    vocab_size = logits.shape[1]
    unlimited = top_k >= vocab_size
    any_unlimited = bool(unlimited.any())
    # top_k alone needs one candidate past the k-th (to see a tie at the edge)
    width = TOP_CANDIDATES if any_unlimited else min(int(top_k.max()) + 1, TOP_CANDIDATES)
    if vocab_size <= width:
        return _top_k_top_p_sorted(logits, top_k, top_p_drop)
    values, ids = logits.topk(width, dim=-1)                                 # [S, C] descending
    kth = values.gather(1, (top_k.clamp(max=width) - 1)[:, None])
    # a top_k within the candidates whose k-th logit no token outside them ties
    fits = unlimited | ((top_k <= width) & (kth[:, 0] > values[:, -1]))
    values = values.masked_fill(~unlimited[:, None] & (values < kth), float("-inf"))
    # the mass outside the candidates: all of it is dropped when it is at most 1 - top_p (else the row is sorted)
    norm = values.logsumexp(-1)             # a top_k row's whole mass lies in the candidates, an unlimited row's not
    if any_unlimited:
        norm = torch.where(unlimited, logits.logsumexp(-1), norm)
    probs = (values - norm[:, None]).exp()
    outside = (1 - probs.sum(-1, keepdim=True)).clamp(min=0) * unlimited[:, None]
    fits &= (outside <= top_p_drop)[:, 0]
    drop = (outside + probs.flip(-1).cumsum(-1)).flip(-1) <= top_p_drop
    drop[:, 0] = False
    out = torch.full_like(logits, float("-inf")).scatter_(1, ids, values.masked_fill(drop, float("-inf")))
    sorted_rows = (~fits).nonzero().flatten()
    if sorted_rows.numel():
        out[sorted_rows] = _top_k_top_p_sorted(logits[sorted_rows], top_k[sorted_rows], top_p_drop[sorted_rows])
    return out


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p_drop: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p by one ascending sort of each whole row."""
    ordered, order = logits.sort(dim=-1)
    kth = ordered.gather(1, (logits.shape[1] - top_k)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= top_p_drop
    drop[:, -1] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def warp_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [S, V] fp32 of non-greedy rows -> logits to sample from: / temperature, then min_p, top_k, top_p.

    Dropped tokens become -inf. Rows that do not ask for a step are not touched by it.
    """
    device, vocab_size = logits.device, logits.shape[1]
    logits = logits / _column([p.temperature for p in params], device)
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, _column([p.min_p for p in params], device))
    picked = [i for i, p in enumerate(params) if 0 < p.top_k < vocab_size or p.top_p < 1]
    if picked:
        index = torch.tensor(picked, dtype=torch.int64, device=device)
        top_k = torch.tensor([min(params[i].top_k or vocab_size, vocab_size) for i in picked], device=device)
        top_p_drop = _column([1.0 - params[i].top_p for i in picked], device)
        logits[index] = apply_top_k_top_p(logits[index], top_k, top_p_drop)
    return logits


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """probs [S, V] (zero where dropped) -> [S] int64: token i with probability p_i / sum(p), by inverse transform,
    the first token whose cumulative probability exceeds u * sum(p) for a uniform u in [0, 1): first the block of
    DRAW_BLOCK tokens (float32 block sums, accumulated in float64), then the token in it (float64).

    A row with a generator draws its u from it alone; the other rows draw together from the default one.
    """
    device = probs.device
    u = torch.empty(len(generators), dtype=torch.float64, device=device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        u[torch.tensor(shared, device=device)] = torch.rand(len(shared), dtype=torch.float64, device=device)
    for i, generator in enumerate(generators):
        if generator is not None:
            u[i] = torch.rand(1, generator=generator, dtype=torch.float64, device=device)[0]
    rows, vocab_size = probs.shape
    if vocab_size % DRAW_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, -vocab_size % DRAW_BLOCK))
    blocks = probs.view(rows, -1, DRAW_BLOCK)
    # the block holding u's token (u < 1 keeps u * total below the total: a block with mass), then the token in it,
    # at most its last token with mass (its float32 sum may round above its tokens' float64 one)
    cumulative = blocks.sum(-1).double().cumsum(-1)                                   # [S, blocks]
    target = u[:, None] * cumulative[:, -1:]
    block = torch.searchsorted(cumulative, target, right=True)
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp(min=0)), 0.0)
    within = blocks.gather(1, block[:, :, None].expand(-1, -1, DRAW_BLOCK))[:, 0].double().cumsum(-1)
    last = torch.searchsorted(within, within[:, -1:].contiguous())                    # its last token with mass
    offset = torch.minimum(torch.searchsorted(within, target - before, right=True), last)
    return (block * DRAW_BLOCK + offset)[:, 0]


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
    """logits [R, V] fp32 (one row per sequence to sample) -> next tokens, and the raw logprobs of the rows whose
    params ask for logprobs.

    Greedy ties go to the lowest token id. top_ids/top_logprobs have N = the largest `logprobs` asked
    for in the batch; rows asking fewer ignore the extra columns.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [rows, vocab] with one row per SamplingRow ({len(rows)}), "
                         f"got shape {tuple(logits.shape)}.")
    work = mask_stop_tokens(logits.float(), rows)               # (logits themselves where nothing is masked)
    constrained = [i for i, row in enumerate(rows) if row.token_bitmask is not None]
    if constrained:
        if work is logits:                                      # the bitmasks apply in place
            work = work.clone()
        apply_token_bitmasks(work, constrained, [rows[i].token_bitmask for i in constrained])
    work = apply_penalties(work, rows)
    token_ids = work.argmax(dim=-1)                 # the greedy rows' tokens (one op for every row, no scatter)
    randoms = [i for i, row in enumerate(rows) if not row.params.greedy]
    if randoms:
        index = torch.tensor(randoms, dtype=torch.int64, device=logits.device)
        warped = warp_logits(work[index], [rows[i].params for i in randoms])
        token_ids[index] = _draw(warped.softmax(dim=-1), [rows[i].generator for i in randoms])
    return _logprobs_where_asked(logits, token_ids, rows)


def _logprobs_where_asked(logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
    """The SampleResult of token_ids [R], with raw logprobs, ranks and top alternatives computed for the rows whose
    params ask for logprobs only (the others: logprob NaN, rank 0, no alternatives)."""
    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    num_top = max((rows[i].params.logprobs for i in asked), default=0)
    if len(asked) == len(rows):
        return gather_logprobs(raw_logprobs(logits), token_ids, num_top)
    count, device = len(rows), logits.device
    result = SampleResult(token_ids, torch.full((count,), math.nan, device=device),
                          torch.zeros(count, dtype=torch.int64, device=device),
                          torch.zeros(count, num_top, dtype=torch.int64, device=device),
                          torch.full((count, num_top), math.nan, device=device))
    if asked:
        index = torch.tensor(asked, dtype=torch.int64, device=device)
        part = gather_logprobs(raw_logprobs(logits[index]), token_ids[index], num_top)
        for name in ("logprobs", "ranks", "top_ids", "top_logprobs"):
            getattr(result, name)[index] = getattr(part, name)
    return result
