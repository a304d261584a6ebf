"""kestrel_cpu::paged_mla (kestrel.ops.cpu): against paged_mla_decode's torch ops in float64 within float32's
first-order error bound (the scores' dot products, the online softmax's exponentials, rescalings and sums), dense and
over selected positions, with float32, bfloat16 and FP8 rows, pages out of order, several sequences, tokens that see
no row; every row a token may not read set to NaN (a read would show); registered soundly (opcheck); positions and
pages outside the cache refused. paged_mla_decode takes it for float32 CPU queries, eagerly and traced, and keeps
its torch ops in deterministic inference."""

from __future__ import annotations

import pytest
import torch

import kestrel.ops.cpu as cpu
from kestrel.ops import batch_invariant
from kestrel.ops.torch import paged_attention
from kestrel.ops.torch.paged_attention import paged_rows, read_rows
from helpers import OpCalls, gamma, traced_targets

PAGE, PAGES, WIDTH, VALUE_DIM, HEADS = 4, 20, 40, 24, 3
SEQ, POSITIONS = [0, 0, 1, 1, 2], [2, 17, 0, 23, 9]


@pytest.fixture(autouse=True)
def kernels() -> None:
    assert cpu.load()


def problem(dtype: torch.dtype, sparse: bool, seed: int) -> dict:
    """A cache of PAGES pages (rows no token may read hold NaN), three sequences' page tables (pages out of order),
    five query tokens; with sparse, 6 positions per token (some past it, some -1; the last token's all unreadable)."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randperm(PAGES, generator=generator)[:3 * 6].view(3, 6)
    seq, positions = torch.tensor(SEQ), torch.tensor(POSITIONS)
    rows = torch.randn(PAGES * PAGE, WIDTH, generator=generator) * 2
    selected = None
    if sparse:
        selected = torch.randint(-1, 24, (len(SEQ), 6), generator=generator)
        selected[-1] = torch.tensor([-1, 10, 11, 20, -1, 23])                     # all past position 9
    readable = torch.zeros(PAGES * PAGE, dtype=torch.bool)
    for t, (n, p) in enumerate(zip(SEQ, POSITIONS)):
        seen = torch.arange(p + 1) if selected is None else selected[t][(selected[t] >= 0) & (selected[t] <= p)]
        readable[paged_rows(table, PAGE, torch.tensor(n), seen)] = True
    scales = None
    if dtype == torch.float8_e4m3fn:
        scales = rows.abs().amax(-1) / 448 + 0.01
        values = (rows / scales.unsqueeze(-1)).to(dtype)
    else:
        values = rows.to(dtype)
    values = torch.where(readable.unsqueeze(-1), values.float(), float("nan")).to(dtype)
    return dict(q=torch.randn(len(SEQ), HEADS, WIDTH, generator=generator), cache_values=values, cache_scales=scales,
                page_table=table, page_size=PAGE, seq_index=seq, positions=positions, scale=WIDTH ** -0.5,
                value_dim=VALUE_DIM, selected=selected)


def visible(pb: dict) -> torch.Tensor:
    """Which positions 0..23 each token reads [T, 24] bool."""
    position = torch.arange(24)
    seen = position <= pb["positions"].unsqueeze(1)
    if pb["selected"] is None:
        return seen
    listed = torch.zeros_like(seen).scatter_(1, pb["selected"].clamp(min=0), pb["selected"] >= 0)
    return seen & listed


def bound(pb: dict) -> torch.Tensor:
    """First order, in float64: each score's error gamma_{Dk+1} scale sum |q row| (dot product, scale); the softmax
    weights' relative error twice the largest score error plus gamma_{3S+4} (an exponential, a rescaling and a sum
    per row, the final division) in numerator and denominator alike; o's error that times sum p |v|."""
    mask = visible(pb)
    positions = paged_rows(pb["page_table"], PAGE, pb["seq_index"].unsqueeze(1), torch.arange(24))
    rows = read_rows(pb["cache_values"], pb["cache_scales"], positions, torch.float64)                # [T, 24, Dk]
    rows = torch.where(mask.unsqueeze(-1), rows, 0)
    q = pb["q"].double()
    score_error = gamma(WIDTH + 1) * pb["scale"] * torch.einsum("thd,tsd->ths", q.abs(), rows.abs())
    scores = (pb["scale"] * torch.einsum("thd,tsd->ths", q, rows)).masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num()
    count = mask.sum(-1).view(-1, 1, 1)
    largest = score_error.masked_fill(~mask.unsqueeze(1), 0).amax(-1, keepdim=True)
    relative = 2 * largest + 2 * gamma(1) * (3 * count + 4)
    return relative * torch.einsum("ths,tsv->thv", probs, rows[..., :VALUE_DIM].abs())


def run_kernel(pb: dict) -> torch.Tensor:
    return torch.ops.kestrel_cpu.paged_mla(*pb.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_is_the_float64_attention_within_float32s_bound(dtype, sparse, threads) -> None:
    pb = problem(dtype, sparse, seed=int(sparse) * 10 + threads)
    exact = paged_attention.paged_mla_decode(**{**pb, "q": pb["q"].double()})          # torch ops (float64 q)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        actual = run_kernel(pb)
    finally:
        torch.set_num_threads(before)
    assert actual.dtype == torch.float32 and actual.shape == (len(SEQ), HEADS, VALUE_DIM)
    error = (actual.double() - exact).abs()
    allowed = bound(pb)
    assert bool((error <= allowed).all()), f"largest error / bound {float((error / allowed).max()):.3g}"
    if sparse:
        assert torch.equal(actual[-1], torch.zeros_like(actual[-1]))      # a token that sees no row: zeros


def test_the_op_is_registered_soundly_and_refuses_what_lies_outside_the_cache() -> None:
    pb = problem(torch.float32, sparse=True, seed=5)
    pb["cache_values"] = pb["cache_values"].nan_to_num()
    torch.library.opcheck(torch.ops.kestrel_cpu.paged_mla.default, tuple(pb.values()))
    with pytest.raises(RuntimeError, match="outside the page table"):
        run_kernel({**pb, "positions": pb["positions"] + 24})
    with pytest.raises(RuntimeError, match="outside the cache"):
        run_kernel({**pb, "page_table": pb["page_table"] + PAGES})
    with pytest.raises(RuntimeError, match="seq_index"):
        run_kernel({**pb, "seq_index": pb["seq_index"] + 3})
    with pytest.raises(RuntimeError, match="need their float32 scales"):
        run_kernel({**pb, "cache_values": pb["cache_values"].to(torch.float8_e4m3fn)})


@pytest.mark.parametrize("mode", ["eager", "traced", "deterministic", "float64", "kernels off"])
def test_paged_mla_decode_takes_the_kernel_for_float32_cpu_queries(mode) -> None:
    """The kernel's one call on the op's own arguments (exactly what calling it gives), eagerly and traced; no call
    in deterministic inference, for other query dtypes or with the kernels off."""
    pb = problem(torch.float32, sparse=True, seed=9)
    pb["cache_values"] = pb["cache_values"].nan_to_num()
    if mode == "float64":
        pb["q"] = pb["q"].double()
    kernel = mode in ("eager", "traced")
    if mode == "traced":
        actual, targets = traced_targets(paged_attention.paged_mla_decode, **pb)
        assert any("kestrel_cpu.paged_mla" in target for target in targets)
    else:
        cpu.set_enabled(mode != "kernels off")
        try:
            with OpCalls() as calls, (batch_invariant.invariant() if mode == "deterministic"
                                      else torch.inference_mode()):
                actual = paged_attention.paged_mla_decode(**pb)
        finally:
            cpu.set_enabled(True)
        assert calls.names.count("kestrel_cpu.paged_mla") == kernel
    if kernel:
        assert torch.equal(actual, run_kernel(pb))
