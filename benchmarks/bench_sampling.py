"""The sampling step on the CPU at the bundled model's vocabulary (4,096) and the K3 family's (163,840): kestrel's
sampler against its previous form, one run.

Logits: the bundled model's real next-token logits at 32 positions of its held-out sample (float32); for 163,840
tokens the same 4,096 logits sit at random ids and the other ids get logits drawn from N(the row's minimum, 1), so
each row's distribution has the bundled model's shape with a long tail of unlikely tokens. Points: 1 and 32 rows,
each row with the same parameters: greedy; greedy asking for 5 logprobs; temperature 1; temperature 0.7 with top_p
0.95; top_k 50. "previous" is kestrel's sampler before this form, rebuilt here from today's pieces only to measure
against: a copy of the logits, raw logprobs and ranks for every row, asked for or not; top_k and top_p by sorting
each whole row; a draw by the exponential race (argmax p_i / q_i, q_i ~ Exponential(1), one draw per token of the vocabulary). kestrel now
computes logprobs only for the rows that ask, decides top_k and top_p among each row's TOP_CANDIDATES largest logits
(sorting whole only the rows whose kept tokens reach past them: "rows sorted whole"), and draws by inverse transform
(one uniform per row). "same kept tokens": rows whose top_k / top_p keep the same tokens both ways; greedy tokens are
compared too. Medians of ROUNDS calls after one warm-up, the two samplers alternating.
Writes the section "sampling" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_sampling.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import THREADS, machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel.engine import sampling  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402
from kestrel.engine.sampling import (SampleResult, SamplingParams, SamplingRow, gather_logprobs,  # noqa: E402
                                     raw_logprobs, sample, warp_logits)
from kestrel.engine.tokenizer import Tokenizer  # noqa: E402
from kestrel.layers.batch import ForwardBatch  # noqa: E402
from kestrel.models.checkpoint import load_model  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_sampling.py"
ROUNDS = 9
ROWS = (1, 32)
K3_VOCAB = 163_840
MODES = {"greedy": dict(temperature=0), "greedy, 5 logprobs": dict(temperature=0, logprobs=5),
         "temperature 1": dict(temperature=1.0), "temperature 0.7, top_p 0.95": dict(temperature=0.7, top_p=0.95),
         "top_k 50": dict(top_k=50)}


@torch.inference_mode()
def bundled_logits(rows: int) -> torch.Tensor:
    """The bundled model's next-token logits [rows, 4096] fp32 at `rows` positions spread over its held-out sample."""
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    ids = Tokenizer.from_folder(BUNDLED_MODEL).encode((BUNDLED_MODEL / "heldout_sample.txt").read_text(),
                                                      add_special_tokens=False)[:512]
    hidden = model(torch.tensor(ids), ForwardBatch.build([len(ids)]), None)
    return model.compute_logits(hidden[torch.linspace(16, len(ids) - 1, rows).long()]).float()


def widen(logits: torch.Tensor, vocab: int, seed: int = 0) -> torch.Tensor:
    """logits [R, V] -> [R, vocab]: the V logits at random ids, the others drawn from N(the row's minimum, 1)."""
    gen = torch.Generator().manual_seed(seed)
    rows, width = logits.shape
    wide = logits.amin(-1, keepdim=True) + torch.randn(rows, vocab, generator=gen)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:width] for _ in range(rows)])
    return wide.scatter_(1, ids, logits)


def previous_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
    """kestrel's previous sampler (for rows without penalties or stop-token masking): every row's logprobs, whole
    sorts for top_k / top_p, the exponential race."""
    raw = raw_logprobs(logits)
    work = logits.to(torch.float32, copy=True)
    token_ids = work.argmax(-1)
    randoms = [i for i, row in enumerate(rows) if not row.params.greedy]
    if randoms:
        index = torch.tensor(randoms)
        with sorting_whole_rows():
            probs = warp_logits(work[index], [rows[i].params for i in randoms]).softmax(dim=-1)
        token_ids[index] = (probs / torch.empty_like(probs).exponential_().clamp_min_(1e-38)).argmax(dim=-1)
    return gather_logprobs(raw, token_ids, max((row.params.logprobs or 0 for row in rows), default=0))


def sorted_whole(logits: torch.Tensor, params: SamplingParams) -> int:
    """How many rows of logits kestrel's truncation sorted whole (their kept tokens may reach past the candidates)."""
    if not (params.top_k or params.top_p < 1):
        return 0
    rows = []
    sort = sampling._top_k_top_p_sorted
    sampling._top_k_top_p_sorted = lambda part, *args: rows.append(part.shape[0]) or sort(part, *args)
    try:
        warp_logits(logits, [params] * logits.shape[0])
    finally:
        sampling._top_k_top_p_sorted = sort
    return sum(rows)


def same_kept(logits: torch.Tensor, params: SamplingParams) -> int:
    """Rows whose warped logits keep the same tokens under both samplers' truncations."""
    ours = torch.isfinite(warp_logits(logits, [params] * logits.shape[0]))
    with sorting_whole_rows():
        theirs = torch.isfinite(warp_logits(logits, [params] * logits.shape[0]))
    return int((ours == theirs).all(-1).sum())


@contextmanager
def sorting_whole_rows() -> Iterator[None]:
    """Within it, warp_logits truncates by sorting every whole row (as kestrel's previous sampler did)."""
    saved, sampling.apply_top_k_top_p = sampling.apply_top_k_top_p, sampling._top_k_top_p_sorted
    try:
        yield
    finally:
        sampling.apply_top_k_top_p = saved


def milliseconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    load_before = os.getloadavg()[0]
    real = bundled_logits(max(ROWS))
    vocabularies = {"4,096 (bundled)": real, "163,840 (K3)": widen(real, K3_VOCAB)}
    table = []
    for vocab_name, all_logits in vocabularies.items():
        for count in ROWS:
            logits = all_logits[:count].contiguous()
            for mode, fields in MODES.items():
                params = SamplingParams(**fields)
                rows = [SamplingRow(params, [], [], None) for _ in range(count)]
                new, old = (lambda: sample(logits, rows)), (lambda: previous_sample(logits, rows))
                new(), old()
                times = [(milliseconds(new), milliseconds(old)) for _ in range(ROUNDS)]
                ours, theirs = (statistics.median(column) for column in zip(*times))
                if params.greedy:
                    same = f"{int((new().token_ids == old().token_ids).sum())}/{count} tokens"
                else:
                    same = f"{same_kept(logits, params)}/{count}"
                table.append([vocab_name, count, mode, f"{theirs:,.2f}", f"{ours:,.2f}", f"{theirs / ours:.1f}x",
                              sorted_whole(logits, params), same])
                print(table[-1], flush=True)
    load_after = os.getloadavg()[0]
    body = "\n\n".join([
        "## Sampling on the CPU (sampling)",
        "kestrel.engine.sampling.sample against its previous form (rebuilt in the script only to measure against: "
        "logprobs for every row, asked for or not; top_k and top_p by sorting each whole row; a draw by the "
        "exponential race, one exponential per token of the vocabulary). kestrel now computes logprobs only for "
        "the rows that ask, decides top_k and top_p among each row's "
        f"{sampling.TOP_CANDIDATES:,} largest logits (\"rows sorted whole\": rows whose kept tokens reach past "
        "them, sorted as before), and draws by inverse transform (one uniform per row). Logits: the bundled "
        "model's real next-token logits at 32 positions of its held-out sample; for 163,840 tokens the same "
        "logits at random ids and the other ids drawn from N(row minimum, 1). Every row of a point has the same "
        f"parameters. Milliseconds per call, medians of {ROUNDS} calls, the two alternating. \"same\": greedy "
        "tokens, or rows whose truncation keeps the same tokens both ways.",
        f"{machine()}; load average {load_before:.1f} before, {load_after:.1f} after on {os.cpu_count()} cores "
        "shared with other work, so compare the ratios, not the absolute times.",
        markdown_table(["vocabulary", "rows", "parameters", "previous ms", "kestrel ms", "speedup",
                        "rows sorted whole", "same"], table),
        f"Rerun: `{COMMAND}`",
    ])
    write_section("sampling", body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
