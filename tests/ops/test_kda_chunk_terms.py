"""kestrel_cpu::kda_chunk_terms (kestrel.ops.cpu) against KDA's intra-chunk terms computed by the torch ops in
float64 (kestrel.ops.torch.kda._intra_chunk_terms: recursive halving and a blockwise inverse, another computation
of the same quantities); chunk_kda on the kernel against fla's naive recurrence is test_kda.py's.

Tolerance: max abs error at most 1e-4 times the float64 term's largest magnitude, as test_kda's. Its largest part is
float32's rounding of the cumulative log decays (each exponent G_i - G_j off by about sqrt(C) u |G|, the same in the
torch float32 path), then exp_u20's 20 ulp and the K-term dot products; observed up to 4.3e-5 (keys_to_end over 128
tokens of the "spans 35" gate, where |G| reaches 280), below 1e-5 elsewhere.

Gates: gentle (g in [-0.1, 0]: every block's decay spans less than MAX_SPAN, scored as one product), spans 35
(a block's last rows decayed to its first token by more than the flush at -30, still one product), steep (g in
[-8, -6]: a whole block spans more than MAX_SPAN, scored elementwise), Kimi-Linear's (A_log up to 2.7, both) and
extreme (A_log 4, log decays to -300 per step: mostly exact zeros). Every chunk and head is one task, so a chunk's
terms are the same bit for bit in any batch and on any number of threads (deterministic inference relies on it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fla.ops.kda.gate import naive_kda_gate

import kestrel.ops.cpu as cpu
from kestrel.ops.torch import kda

FIELDS = list(kda.IntraChunkTerms.__dataclass_fields__)
RELATIVE_TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def kernels() -> None:
    assert cpu.load()


def operands(chunks: int, heads: int, size: int, key_dim: int, value_dim: int, gate: str, seed: int = 0
             ) -> tuple[torch.Tensor, ...]:
    """q (scaled), k, v, g, beta of `chunks` chunks: [B, H, C, K] and [B, H, C, V], beta [B, H, C]."""
    generator = torch.Generator().manual_seed(seed)
    shape = (chunks, heads, size, key_dim)
    q, k = (F.normalize(torch.randn(shape, generator=generator), dim=-1) for _ in range(2))
    if gate == "gentle":
        g = -0.1 * torch.rand(shape, generator=generator)
    elif gate == "spans 35":            # -5 at positions 1..7 of every 16, so blocks of 8 or 16 tokens span 35
        step = torch.where((torch.arange(size) % 16 >= 1) & (torch.arange(size) % 16 <= 7), -5.0, 0.0)
        g = step.view(size, 1) - 0.01 * torch.rand(shape, generator=generator)
    elif gate == "steep":
        g = -6 - 2 * torch.rand(shape, generator=generator)
    else:
        a_log = torch.full((heads,), 4.0) if gate == "extreme" else 2.7 * torch.rand(heads, generator=generator)
        raw = torch.randn(chunks * size, heads, key_dim, generator=generator)
        g = naive_kda_gate(raw, a_log, None).view(chunks, size, heads, key_dim).transpose(1, 2).contiguous()
    v = torch.randn(chunks, heads, size, value_dim, generator=generator)
    beta = torch.rand(chunks, heads, size, generator=generator)
    return q * key_dim ** -0.5, k, v, g, beta


@pytest.mark.parametrize("gate", ["gentle", "spans 35", "steep", "kimi-linear", "extreme"])
@pytest.mark.parametrize("size, key_dim, value_dim", [(1, 8, 8), (7, 5, 3), (17, 32, 16), (64, 48, 48),
                                                      (100, 40, 24), (128, 64, 32)])
def test_the_terms_match_the_float64_torch_terms(gate: str, size: int, key_dim: int, value_dim: int) -> None:
    args = operands(3, 2, size, key_dim, value_dim, gate)
    got = torch.ops.kestrel_cpu.kda_chunk_terms(*args)
    want = kda._intra_chunk_terms(*(x.double() for x in args))
    for name, term in zip(FIELDS, got, strict=True):
        expected = getattr(want, name)
        assert term.dtype == torch.float32 and term.shape == expected.shape, name
        torch.testing.assert_close(term.double(), expected, rtol=0,
                                   atol=RELATIVE_TOLERANCE * expected.abs().max().item(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("gate", ["gentle", "steep"])
def test_a_chunks_terms_are_the_same_in_any_batch_and_on_any_threads(gate: str) -> None:
    args = operands(5, 3, 64, 48, 40, gate, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = torch.ops.kestrel_cpu.kda_chunk_terms(*args)
    finally:
        torch.set_num_threads(threads)
    for b in range(5):
        alone = torch.ops.kestrel_cpu.kda_chunk_terms(*(x[b:b + 1].contiguous() for x in args))
        for name, whole, one in zip(FIELDS, batched, alone, strict=True):
            assert torch.equal(whole[b:b + 1], one), name


def test_chunk_kda_takes_the_kernel_for_float32_without_gradients_only(monkeypatch) -> None:
    calls, kernel = [], torch.ops.kestrel_cpu.kda_chunk_terms
    monkeypatch.setattr(torch.ops.kestrel_cpu, "kda_chunk_terms", lambda *a: calls.append(1) or kernel(*a))
    tokens, generator = 70, torch.Generator().manual_seed(2)
    q, k = (F.normalize(torch.randn(tokens, 2, 16, generator=generator), dim=-1) for _ in range(2))
    v, g, beta = (torch.randn(tokens, 2, 8, generator=generator), -torch.rand(tokens, 2, 16, generator=generator),
                  torch.rand(tokens, 2, generator=generator))
    lengths = torch.tensor([0, 30, tokens])
    kda.chunk_kda(q, k, v, g, beta, lengths)
    assert len(calls) == 1
    kda.chunk_kda(q.double(), k, v, g, beta, lengths)
    kda.chunk_kda(q, k, v.requires_grad_(), g, beta, lengths)
    cpu.set_enabled(False)
    try:
        kda.chunk_kda(q, k, v.detach(), g, beta, lengths)
    finally:
        cpu.set_enabled(True)
    assert len(calls) == 1


def test_soundness_and_refusals() -> None:
    args = operands(2, 2, 9, 8, 4, "kimi-linear")
    torch.library.opcheck(torch.ops.kestrel_cpu.kda_chunk_terms.default, args)
    q, k, v, g, beta = args
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.kestrel_cpu.kda_chunk_terms(q.double(), k, v, g, beta)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.kestrel_cpu.kda_chunk_terms(q, k, v, g.transpose(2, 3).contiguous().transpose(2, 3), beta)
    with pytest.raises(RuntimeError, match=r"v \[B, H, C, V\]"):
        torch.ops.kestrel_cpu.kda_chunk_terms(q, k, v[:, :, :-1], g, beta)
    with pytest.raises(RuntimeError, match=r"beta \[B, H, C\]"):
        torch.ops.kestrel_cpu.kda_chunk_terms(q, k, v, g, beta[..., None])
