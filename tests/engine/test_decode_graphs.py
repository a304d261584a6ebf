"""CUDA-graph decode (kestrel.engine.decode_graphs) on the CPU: the padded static step that a graph captures against
the dynamic decode step, its freedom from host synchronisation (what capture needs), and the engine's greedy tokens
with it. Off CUDA each replay runs the captured step eagerly, so everything but the capture itself is exercised."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kestrel.layers.linear as linear_layers
import kestrel.layers.moe as moe_layers
from helpers import FAMILY, assert_idle, tiny_model
from kestrel import LLM, SamplingParams
from kestrel.engine import engine as engine_module
from kestrel.engine.args import EngineArgs
from kestrel.engine.cache.page_table import PageTable
from kestrel.engine.decode_graphs import DecodeGraphs, batch_sizes
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.layers.linear import Linear, column_major_pays
from kestrel.layers.mla import AUTO, PLAIN, GatedMLA
from kestrel.layers.moe import hold_dense_experts, pack_onednn_experts
from kestrel.ops import backend, cpu

PAGE = 4
SLOTS, PAGES = 5, 24                 # the last of each is the scratch slot and page
PROMPTS = [[5, 9, 14, 3, 77, 2], [8], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
SEQ_SLOTS = [3, 0, 2]                # out of order, slot 1 unused
SEQ_PAGES = [[10, 3, 15, 1, 8], [5, 12, 0, 20, 9], [14, 6, 19, 2, 17]]
STEPS = [3, 8, 8]                    # decode steps per sequence: the batch shrinks from 3 to 2 sequences


class HostSyncDetector(TorchDispatchMode):
    """Records the ops a CUDA graph cannot capture faithfully: reads of device values on the host, outputs whose
    shape depends on values, and host data copied in (which a graph would freeze at its captured value)."""

    SYNCING = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.masked_select",
               "aten.unique_consecutive", "aten._unique2", "aten.unique_dim", "aten.lift_fresh"}
    SIZED_BY_VALUES = {"aten.repeat_interleave.Tensor", "aten.repeat_interleave.self_Tensor"}   # unless output_size

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func.overloadpacket) in self.SYNCING or (str(func) in self.SIZED_BY_VALUES
                                                        and kwargs.get("output_size") is None):
            self.found.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture
def restore_backends():
    yield
    backend.set_backend(None)


def prefilled_cache(model, kv_dtype: torch.dtype | None = None, dtype: torch.dtype = torch.float32) -> HybridCache:
    """A zeroed cache of dtype (activations, states and pages) holding PROMPTS, prefilled by the dynamic path into
    SEQ_SLOTS and SEQ_PAGES."""
    cache = HybridCache.allocate(model.config, SLOTS, PAGES, PAGE, dtype=dtype, state_dtype=dtype, kv_dtype=kv_dtype)
    for state in cache.kda:
        state.conv.zero_()
        state.recurrent.zero_()
    for pages in cache.mla:
        for rows in (pages.latent, pages.index_keys):
            if rows is not None:
                rows.values.zero_()
    batch = ForwardBatch.build([len(p) for p in PROMPTS], None, SEQ_SLOTS, SEQ_PAGES, PAGE)
    model(torch.tensor([t for p in PROMPTS for t in p]), batch, cache)
    return cache


def page_table() -> PageTable:
    """SEQ_PAGES in the rows of SEQ_SLOTS; the other rows (the scratch slot's among them) all the scratch page."""
    table = PageTable(SLOTS, 8, fill=PAGES - 1, device="cpu")
    for slot, pages in zip(SEQ_SLOTS, SEQ_PAGES):
        table.set(slot, 0, pages)
    table.flush()
    return table


def cache_tensors(cache: HybridCache) -> list[torch.Tensor]:
    """Every stored tensor, the scratch slot and scratch page left out."""
    out = [t[:SLOTS - 1] for state in cache.kda for t in (state.conv, state.recurrent)]
    for pages in cache.mla:
        out += [rows.values[:(PAGES - 1) * PAGE] for rows in (pages.latent, pages.index_keys) if rows is not None]
    return out


@pytest.mark.parametrize("preset,ops", [("k3.1-tiny", "torch"), ("kimi-linear-tiny", "torch"),
                                        ("k3.1-tiny", "triton")])
@torch.inference_mode()
def test_padded_graph_steps_equal_dynamic_steps(preset, ops, restore_backends):
    """Padding (3 sequences in a graph of 4, then 2), slots and pages out of order, the page-table width bucket
    growing with the context: the same logits as dynamic steps on the torch reference ops, and the same cache
    contents outside scratch."""
    backend.set_backend("torch")
    model, _ = tiny_model(preset)
    dynamic_cache = prefilled_cache(model)
    static_cache = prefilled_cache(model)
    graphs = DecodeGraphs(model, static_cache, page_table(), max_batch_size=8, scratch_slot=SLOTS - 1)
    lengths = [len(p) for p in PROMPTS]
    tokens = [p[-1] for p in PROMPTS]
    expected_keys = set()
    steps = STEPS if ops == "torch" else [1, 1, 1]      # Triton's interpreter: one step, 3 sequences padded to 4
    for step in range(max(steps)):
        live = [i for i in range(len(PROMPTS)) if step < steps[i]]
        prefix = [lengths[i] for i in live]
        width = max(p // PAGE + 1 for p in prefix)
        batch = ForwardBatch.build([1] * len(live), prefix, [SEQ_SLOTS[i] for i in live],
                                   [SEQ_PAGES[i][:width] for i in live], PAGE)
        ids = [tokens[i] for i in live]
        backend.set_backend("torch")
        expected = model.compute_logits(model(torch.tensor(ids), batch, dynamic_cache))
        backend.set_backend(ops)
        got = graphs.run(ids, prefix, [SEQ_SLOTS[i] for i in live], width).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        expected_keys.add((next(b for b in (1, 2, 4, 8) if b >= len(live)), 1 << (width - 1).bit_length(), 1))
        for j, i in enumerate(live):
            tokens[i] = int(expected[j].argmax())
            lengths[i] += 1
    assert set(graphs.steps) == expected_keys and len(expected_keys) >= (3 if ops == "torch" else 1)
    for got, expected in zip(cache_tensors(static_cache), cache_tensors(dynamic_cache), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# float32's worst-case error against float64, first order (Higham's gamma_n summed over the chain of reductions a
# step runs: 6 layers x ~8 chained reductions x <= 96 terms, about 2^12 roundings), relative to a tensor's largest
# magnitude. Either float32 path may round anywhere within it, in any summation order the CPU's kernels pick.
FLOAT32_STEP_BOUND = 2.0**12 * 2.0**-24


def assert_float32_of(got: torch.Tensor, reference: torch.Tensor) -> None:
    """got (float32) is reference (the float64 step) within FLOAT32_STEP_BOUND of reference's largest magnitude."""
    bound = FLOAT32_STEP_BOUND * float(reference.abs().max())
    torch.testing.assert_close(got.double(), reference.double(), rtol=0, atol=bound)


@pytest.mark.parametrize("onednn", [False, True], ids=["packed", "onednn-copies"])
@torch.inference_mode()
def test_the_traced_step_equals_the_eager_step(onednn, restore_backends, monkeypatch):
    """The static step as torch.compile traces it into one graph (aot_eager: the graph inductor compiles for
    --enable-torch-compile, run without generating code; tests/engine/test_compiled_decode.py compiles it) and the
    eager step both give the float64 eager step's logits and cache writes, within float32's error bound, over two
    steps of 3 sequences padded to 4 (K3.1: indexer, AttnRes, MXFP4 experts, 16 of them so that the 8 token-expert
    pairs run in the graph; the grouped custom op that more pairs call is checked in tests/ops/test_moe_experts.py);
    also with the experts' float32 copy held in oneDNN's layout too (--moe-onednn-experts), which traced graphs leave
    out. The traced graph reorders reductions (its decompositions, the CPU's vector width), so the two float32 paths
    agree only to float32's error, not bit for bit."""
    backend.set_backend("torch")
    model, _ = tiny_model("k3.1-tiny", num_experts=16)
    reference = copy.deepcopy(model).double()
    if onednn:
        monkeypatch.setattr(moe_layers, "EXPERT_PACKED_MIN_WEIGHT", 1)
        monkeypatch.setattr(linear_layers, "ONEDNN", True)
        hold_dense_experts(model, torch.float32)
        assert pack_onednn_experts(model) > 0
    caches = [prefilled_cache(model), prefilled_cache(model), prefilled_cache(reference, dtype=torch.float64)]
    eager, traced, exact = (DecodeGraphs(m, cache, page_table(), max_batch_size=4, scratch_slot=SLOTS - 1,
                                         compile=compile)
                            for m, cache, compile in zip((model, model, reference), caches, (None, "aot_eager", None)))
    ids, prefix = [1, 2, 3], [len(p) for p in PROMPTS]
    for _ in range(2):
        expected = exact.run(ids, prefix, SEQ_SLOTS, 4).logits.clone()
        assert_float32_of(eager.run(ids, prefix, SEQ_SLOTS, 4).logits, expected)
        assert_float32_of(traced.run(ids, prefix, SEQ_SLOTS, 4).logits, expected)
        ids, prefix = expected.argmax(-1).tolist(), [p + 1 for p in prefix]
    assert traced.forward is not traced._forward and set(traced.steps) == {(4, 4, 1)}
    for *got, want in zip(*(cache_tensors(cache) for cache in caches), strict=True):
        for tensor in got:
            assert_float32_of(tensor, want)


class OpNames(TorchDispatchMode):
    """Records the name of every op dispatched."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


CPU_KERNELS = {"kestrel_cpu.linear_dots", "kestrel_cpu.expert_mlp", "kestrel_cpu.kda_decode_step_",
               "kestrel_cpu.paged_mla"}


@pytest.mark.parametrize("preset", FAMILY)
@pytest.mark.parametrize("sequences", [1, 3])
@torch.inference_mode()
def test_the_default_eager_step_runs_on_the_cpu_kernels_within_float32s_bound(preset, sequences, restore_backends,
                                                                           torch_paths):
    """The default CPU decode step (eager, kestrel's C++ kernels: products of up to 4 rows, the routed experts,
    MXFP4 ones decoded in registers, the KDA state) and the same step on torch's kernels (--disable-cpu-kernels)
    both give the float64 step's logits and cache writes within float32's error bound, at 1 sequence and at 3
    padded to 4, for every family member (Kimi-Linear's dense experts, K3's and K3.1's MXFP4 ones); and the kernels
    run only when enabled. (The fp8 cache rounds each written row to 3 mantissa bits, outside float32's bound: the
    engine's fp8 tests, tests/engine/test_engine.py, run on the kernels by default.)"""

    backend.set_backend("torch")
    # enough experts that the float64 step multiplies each in use alone (torch's grouped GEMM has no float64)
    model, _ = tiny_model(preset, num_experts=256)
    reference = copy.deepcopy(model).double()
    assert cpu.load()
    ids, prefix = [1, 2, 3][:sequences], [len(p) for p in PROMPTS][:sequences]
    caches = [prefilled_cache(model), prefilled_cache(model), prefilled_cache(reference, dtype=torch.float64)]
    steps = [DecodeGraphs(m, cache, page_table(), max_batch_size=4, scratch_slot=SLOTS - 1)
             for m, cache in zip((model, model, reference), caches)]
    expected = steps[2].run(ids, prefix, SEQ_SLOTS[:sequences], 4).logits
    for enabled, step in zip((True, False), steps):
        cpu.set_enabled(enabled)
        with OpNames() as ops:
            assert_float32_of(step.run(ids, prefix, SEQ_SLOTS[:sequences], 4).logits, expected)
        assert bool(ops.names & CPU_KERNELS) == enabled, ops.names & CPU_KERNELS
    for *got, want in zip(*(cache_tensors(cache) for cache in caches), strict=True):
        for tensor in got:
            assert_float32_of(tensor, want)


@pytest.mark.parametrize("compile", [None, "aot_eager"])
@torch.inference_mode()
def test_static_verification_equals_dynamic_verification(compile, restore_backends):
    """A verification of 3 tokens for each of 3 sequences (padded to 4), as the static step runs it (eagerly, and as
    torch.compile traces it), against the dynamic step's independent path (variable-length KDA, MLA in the plain
    form): the logits, the hidden states, and every KDA layer's states after every token; the KDA pools left as
    they were, the same latent and index-key pages written."""
    backend.set_backend("torch")
    model, _ = tiny_model("k3.1-tiny", num_experts=16)
    dynamic_cache, static_cache = prefilled_cache(model), prefilled_cache(model)
    pools = [t.clone() for state in static_cache.kda for t in (state.conv, state.recurrent)]
    graphs = DecodeGraphs(model, static_cache, page_table(), max_batch_size=4, scratch_slot=SLOTS - 1,
                          compile=compile, max_tokens_per_seq=3)
    prefix, ids = [len(p) for p in PROMPTS], list(range(7, 16))
    width = max(-(-(p + 3) // PAGE) for p in prefix)
    batch = ForwardBatch.build([3] * 3, prefix, SEQ_SLOTS, [row[:width] for row in SEQ_PAGES], PAGE,
                               keep_token_states=True)
    attention = [layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, GatedMLA)]
    for mla in attention:
        mla.form = PLAIN
    hidden = model(torch.tensor(ids), dataclasses.replace(batch, uniform=False), dynamic_cache)
    for mla in attention:
        mla.form = AUTO
    got = graphs.run(ids, prefix, SEQ_SLOTS, width, 3)
    torch.testing.assert_close(got.hidden, hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.logits, model.compute_logits(hidden), rtol=1e-4, atol=1e-4)
    for state, kept in zip(dynamic_cache.kda, got.token_states, strict=True):
        for got_states, want in ((kept.conv, state.token_states.conv), (kept.recurrent, state.token_states.recurrent)):
            torch.testing.assert_close(got_states[:9], want, rtol=1e-4, atol=1e-4)
    for got_pool, before in zip((t for s in static_cache.kda for t in (s.conv, s.recurrent)), pools, strict=True):
        assert torch.equal(got_pool[:SLOTS - 1], before[:SLOTS - 1])
    for got_rows, want in zip(cache_tensors(static_cache)[len(pools):], cache_tensors(dynamic_cache)[len(pools):],
                              strict=True):
        torch.testing.assert_close(got_rows, want, rtol=1e-4, atol=1e-4)
    assert set(graphs.steps) == {(4, 4, 3)} and (compile is None) == (graphs.forward == graphs._forward)


MAX_BS, MAX_PAGES = 12, 8               # captured sizes 1, 2, 4, 8, 12; up to 32 tokens a sequence
ROUNDS = [12, 1, 3, 2, 8, 5]           # every size (3 padded to 4, 5 to 8); batch 1 right after 12
DECODE_STEPS = 4


def nan_filled_cache(model) -> HybridCache:
    """MAX_BS slots + a scratch slot, MAX_BS * MAX_PAGES pages + a scratch page, all NaN: anything read before it is
    written (a padding row's leftovers, an earlier round's tokens) would show."""
    cache = HybridCache.allocate(model.config, MAX_BS + 1, MAX_BS * MAX_PAGES + 1, PAGE, dtype=torch.float32)
    for state in cache.kda:
        state.conv.fill_(float("nan"))
        state.recurrent.fill_(float("nan"))
    for pages in cache.mla:
        for rows in (pages.latent, pages.index_keys):
            if rows is not None:
                rows.values.fill_(float("nan"))
    return cache


@torch.inference_mode()
def test_every_captured_batch_size_decodes_the_dynamic_steps_greedy_tokens(restore_backends):
    """Rounds of 1 to 12 fresh sequences of K3.1 (random prompts of 1-11 tokens, slots and pages out of order),
    each decoding 4 greedy tokens twice: by dynamic steps, and by the padded static step of every captured size,
    batch 1 included. Each path feeds back its own tokens; every sequence's tokens must agree, and the logits
    closely. One set of graphs serves all rounds, as in the engine."""
    backend.set_backend("torch")
    model, _ = tiny_model("k3.1-tiny")
    gen = torch.Generator().manual_seed(5)
    slots = list(range(MAX_BS - 1, -1, -1))                          # slot MAX_BS is the scratch slot
    pages = torch.randperm(MAX_BS * MAX_PAGES, generator=gen).view(MAX_BS, MAX_PAGES)
    table = PageTable(MAX_BS + 1, MAX_PAGES, fill=MAX_BS * MAX_PAGES, device="cpu")   # that page is scratch
    for slot, row in zip(slots, pages.tolist()):
        table.set(slot, 0, row)
    table.flush()
    dynamic_cache, static_cache = nan_filled_cache(model), nan_filled_cache(model)
    graphs = DecodeGraphs(model, static_cache, table, MAX_BS, scratch_slot=MAX_BS)
    for n in ROUNDS:
        prompts = [torch.randint(0, model.config.vocab_size, (int(length),), generator=gen).tolist()
                   for length in torch.randint(1, 12, (n,), generator=gen)]
        prefill = ForwardBatch.build([len(p) for p in prompts], None, slots[:n], pages[:n], PAGE)
        ids, last = torch.tensor([t for p in prompts for t in p]), prefill.cu_seqlens[1:] - 1
        firsts = [model.compute_logits(model(ids, prefill, cache)[last]).argmax(-1).tolist()
                  for cache in (dynamic_cache, static_cache)]
        dynamic, static = ([[t] for t in first] for first in firsts)
        for step in range(DECODE_STEPS):
            prefix = [len(p) + step for p in prompts]
            width = max(x // PAGE + 1 for x in prefix)
            batch = ForwardBatch.build([1] * n, prefix, slots[:n], pages[:n, :width], PAGE)
            expected = model.compute_logits(model(torch.tensor([t[-1] for t in dynamic]), batch, dynamic_cache))
            got = graphs.run([t[-1] for t in static], prefix, slots[:n], width).logits
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"batch of {n}, step {step}: {m}")
            for tokens, logits in ((dynamic, expected), (static, got)):
                for seq_tokens, row in zip(tokens, logits):
                    seq_tokens.append(int(row.argmax()))
        assert static == dynamic, f"batch of {n}"
    assert {size for size, _, _ in graphs.steps} == set(batch_sizes(MAX_BS)) == {1, 2, 4, 8, 12}


@pytest.mark.parametrize("ops", ["triton", "torch"])
@torch.inference_mode()
def test_the_captured_step_never_waits_on_the_device(ops, restore_backends):
    """What capture (and torch.compile's single graph) needs, checked on the step a graph records (FP8 KV cache):
    no op reads device values on the host, sizes an output by them, or copies host data in. The torch routed
    experts read their grouping by tolist, which the detector cannot see on the CPU (a compiled step calls them as
    one custom op); building a dynamic batch is the detector's control. Triton's interpreter being slow, the
    prompts are prefilled by the torch ops and the Triton step runs one sequence (the torch step 3, padded to 4)."""
    backend.set_backend("torch")
    model, _ = tiny_model("k3.1-tiny")
    cache = prefilled_cache(model, torch.float8_e4m3fn)
    backend.set_backend(ops)
    graphs = DecodeGraphs(model, cache, page_table(), max_batch_size=4, scratch_slot=SLOTS - 1)
    n = 1 if ops == "triton" else 3
    graphs.run([1, 2, 3][:n], [6, 1, 9][:n], SEQ_SLOTS[:n], 3)
    detector = HostSyncDetector()
    with detector:
        graphs.steps[(1 if n == 1 else 4, 4, 1)]()
    assert detector.found == []
    if ops == "torch":                                   # a verification of 2 tokens per sequence, too
        verifying = DecodeGraphs(model, cache, page_table(), max_batch_size=4, scratch_slot=SLOTS - 1,
                                 max_tokens_per_seq=2)
        verifying.run([1, 2, 3, 4, 5, 6], [6, 1, 9], SEQ_SLOTS, 3, 2)
        with detector:
            verifying.steps[(4, 4, 2)]()
        assert detector.found == []
    with detector:
        ForwardBatch.build([2, 1], [6, 1], SEQ_SLOTS[:2], SEQ_PAGES[:2], PAGE)
    assert detector.found


def test_batch_sizes_cover_every_batch_up_to_the_largest():
    assert batch_sizes(1) == [1]
    assert batch_sizes(3) == [1, 2, 3]
    assert batch_sizes(12) == [1, 2, 4, 8, 12]
    sizes = batch_sizes(128)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 128 and all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


def test_engine_tokens_are_the_same_with_graph_replays(model_dir, monkeypatch):
    """Six greedy requests of different lengths, then one short one alone, through the engine with decode steps
    replayed from graphs (of at most 4 sequences: bigger batches run eagerly) and through the engine without."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (1, 5, 17, 9, 30, 3)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 14, 9, 20, 6, 11)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    lone = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)

    def generate(llm: LLM) -> list[list[int]]:
        outputs = llm.generate(requests, params) + llm.generate([{"prompt_token_ids": [11]}], lone)
        return [o.outputs[0].token_ids for o in outputs]

    plain = LLM(str(model_dir), page_size=4)
    expected = generate(plain)
    assert plain.engine.runner.decode_graphs is None                  # no CUDA here
    monkeypatch.setattr(engine_module, "graphs_supported", lambda device: True)
    llm = LLM(str(model_dir), page_size=4, cuda_graph_max_bs=4)
    graphs = llm.engine.runner.decode_graphs
    assert generate(llm) == expected
    assert {size for size, _, _ in graphs.steps} == {1, 2, 4} and {1, 2, 8} <= {width for _, width, _ in graphs.steps}
    pools = llm.engine.scheduler
    assert graphs.scratch_slot == pools.state_pool.num_slots
    assert (pools.page_table.rows[graphs.scratch_slot] == pools.kv_pool.num_pages).all()
    assert_idle(pools)


def test_cuda_graph_and_torch_compile_flags():
    import argparse
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli(parser.parse_args(["--disable-cuda-graph", "--cuda-graph-max-bs", "32",
                                                  "--enable-torch-compile", "--torch-compile-max-bs", "8"]))
    assert args.disable_cuda_graph and args.cuda_graph_max_bs == 32
    assert args.enable_torch_compile and args.torch_compile_max_bs == 8
    defaults = EngineArgs.from_cli(parser.parse_args([]))
    assert not defaults.disable_cuda_graph and not defaults.enable_torch_compile
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be at least 1"):
        EngineArgs(model="m", cuda_graph_max_bs=0)
    with pytest.raises(ValueError, match="torch_compile_max_bs must be at least 1"):
        EngineArgs(model="m", torch_compile_max_bs=0)


def test_the_engine_compiles_cpu_decode_steps_when_asked(model_dir):
    """--enable-torch-compile on the CPU: decode steps of up to --torch-compile-max-bs sequences go through a
    torch.compile'd step (compiled on first use: tests/engine/test_compiled_decode.py runs it), with the scratch slot
    and page that padding needs, and prefills compile their KDA chunk terms where the CPU kernel does not compute
    them (--disable-cpu-kernels); off by default. The compiled engine
    keeps its weights row-major (single rows multiply as reductions), the eager one holds column-major those that
    column_major_pays names."""
    eager = LLM(str(model_dir), page_size=4).engine
    assert eager.runner.decode_graphs is None and eager.runner.prefill_compile is None
    engine = LLM(str(model_dir), page_size=4, enable_torch_compile=True, torch_compile_max_bs=8).engine
    for e, column_major in ((eager, True), (engine, False)):
        held = [m.weight.stride(0) == 1 for m in e.model.modules()
                if isinstance(m, Linear) and column_major_pays(m.weight)]
        assert held and all(h == column_major for h in held)
    assert engine.runner.prefill_compile is None
    try:
        without_kernels = LLM(str(model_dir), page_size=4, enable_torch_compile=True, disable_cpu_kernels=True)
        assert without_kernels.engine.runner.prefill_compile == "inductor"
    finally:
        cpu.set_enabled(True)                         # --disable-cpu-kernels is process-wide
    graphs, pools = engine.runner.decode_graphs, engine.scheduler
    assert graphs.sizes == [1, 2, 4, 8] and graphs.forward is not graphs._forward and not graphs.capture
    assert graphs.scratch_slot == pools.state_pool.num_slots
    assert (pools.page_table.rows[graphs.scratch_slot] == pools.kv_pool.num_pages).all()
