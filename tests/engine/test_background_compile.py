"""Compiling in the background (--enable-background-compile, kestrel.engine.background_compile): the engine serves a step
eagerly while its graph compiles, on another thread, and then runs the graph, which gives the eager step's results.

Inductor takes tens of seconds per graph, so these compile with aot_eager (the graph inductor would compile, run
without generating code) or stand in a gate for the compile; tests/engine/test_compiled_decode.py (slow) compiles
with inductor."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import threading

import pytest
import torch
from torch._dynamo.utils import counters

from helpers import tiny_model
from kestrel import LLM, SamplingParams
from kestrel.engine.args import EngineArgs
from kestrel.engine.background_compile import BackgroundCompiler, module_calls
from kestrel.engine.compile_cache import cache_bytes, use_compile_cache
from kestrel.engine.decode_graphs import DecodeGraphs
from kestrel.engine.model_runner import PREFILL_TERMS
from kestrel.layers.batch import ForwardBatch
from kestrel.ops import backend
from kestrel.ops.torch import kda
from test_decode_graphs import (FLOAT32_STEP_BOUND, PROMPTS, SEQ_SLOTS, SLOTS, assert_float32_of, page_table,
                                prefilled_cache)

CPU = torch.device("cpu")


@pytest.fixture
def restore_backends():
    yield
    backend.set_backend(None)


def test_the_compile_flags_choose_how_cpu_steps_compile():
    """Eagerly by default; --enable-torch-compile in the foreground, --enable-background-compile in the background;
    never off the CPU; both flags refused."""
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)

    def mode(*flags: str, device: torch.device = CPU) -> str | None:
        return EngineArgs.from_cli(parser.parse_args(list(flags))).torch_compile(device)

    assert mode() is None
    assert mode("--enable-torch-compile") == "foreground"
    assert mode("--enable-background-compile") == "background"
    assert mode("--enable-background-compile", device=torch.device("cuda")) is None
    with pytest.raises(ValueError, match="enable_background_compile must be left unset with --enable-torch-compile"):
        EngineArgs(model="m", enable_torch_compile=True, enable_background_compile=True)


@torch.inference_mode()
def test_a_step_compiled_in_the_background_equals_the_eager_step(restore_backends):
    """While a padded step (3 sequences in a graph of 4) compiles on the compiler's thread, the engine thread runs
    the same step eagerly, again and again, with the same results (fx's tracing, which patches torch.nn.Module for
    the whole process, waits for each, and torch.compiler.is_compiling's process-wide flag changes no path); once
    compiled, the graph gives the float64 step's logits within float32's bound, called with the engine's own cache
    and input buffers (made outside inference mode, as the engine makes them) without compiling again, and the
    background compile left the engine's per-layer state objects alone."""
    backend.set_backend("torch")
    model, _ = tiny_model("k3.1-tiny", num_experts=16)
    reference = copy.deepcopy(model).double()
    cache = prefilled_cache(model)
    exact = DecodeGraphs(reference, prefilled_cache(reference, dtype=torch.float64), page_table(), max_batch_size=4,
                         scratch_slot=SLOTS - 1)
    ids, prefix = [1, 2, 3], [len(p) for p in PROMPTS]
    expected = exact.run(ids, prefix, SEQ_SLOTS, 4).logits.clone()
    compiler = BackgroundCompiler()
    with torch.inference_mode(False):           # as the engine makes them: its input buffers are no inference tensors
        graphs = DecodeGraphs(model, cache, page_table(), max_batch_size=4, scratch_slot=SLOTS - 1,
                              compile="aot_eager", background=compiler)
    sentinel = object()
    for state in cache.kda:
        state.token_states = sentinel
    before = counters["stats"]["unique_graphs"]
    assert not graphs.available(3, 4)                       # asked for: compiling from now on
    slots = torch.tensor(SEQ_SLOTS)
    batch = ForwardBatch.for_decode(torch.tensor(prefix), slots, graphs.page_table.gather(slots, 4), cache.page_size)
    eager_runs = 0
    while not graphs.available(3, 4) or eager_runs == 0:
        states = [dataclasses.replace(s, conv=s.conv.clone(), recurrent=s.recurrent.clone()) for s in cache.kda]
        with module_calls():         # as the engine holds it through each step
            hidden = model(torch.tensor(ids), batch, dataclasses.replace(cache, kda=states))
        assert_float32_of(model.compute_logits(hidden), expected)
        eager_runs += 1
    assert compiler.wait_idle(60)
    assert all(state.token_states is sentinel for state in cache.kda)
    assert_float32_of(graphs.run(ids, prefix, SEQ_SLOTS, 4).logits, expected)
    assert counters["stats"]["unique_graphs"] == before + 1 and set(graphs.steps) == {(4, 4, 1)}
    compiler.close()


def test_requests_are_served_while_their_graphs_compile(model_dir, monkeypatch):
    """With --enable-background-compile the engine asks at start-up for the batch-1 decode step (and for the KDA
    prefill's chunk terms where the CPU kernel does not compute them: not here), and for every new decode shape as it
    comes; while those compiles are held up, requests of new shapes are prefilled and decoded eagerly, to the tokens
    (and logprobs, within float32's bound) of an engine that never compiles."""
    gate, asked, ask = threading.Event(), [], BackgroundCompiler.ask
    monkeypatch.setattr(BackgroundCompiler, "ask", lambda self, key, compile: (asked.append(key),
                                                                                ask(self, key, gate.wait)))
    prompts = [{"prompt_token_ids": [5 + i, 9, 14, 3] * (1 + 40 * i)} for i in range(3)]   # 4 to 324 tokens
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    eager = [o.outputs[0] for o in LLM(str(model_dir), page_size=4).generate(prompts, params)]
    llm = LLM(str(model_dir), page_size=4, enable_background_compile=True)
    try:
        engine = llm.engine
        assert engine.background is not None and engine.runner.prefill_compile is None
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
        # the eager path on weights laid out for the compiled steps (row-major: other summation orders than the
        # column-major layout of an engine that never compiles), within float32's bound for a step
        got, want = (torch.tensor([[next(iter(step.values())).logprob for step in o.logprobs] for o in run])
                     for run in (outputs, eager))
        torch.testing.assert_close(got, want, rtol=0, atol=FLOAT32_STEP_BOUND * float(want.abs().max()))
        assert not engine.runner.decode_graphs.steps
        assert asked[0] == ("decode step", 1, 1, 1) and PREFILL_TERMS not in asked
        assert any(key[1] == 4 for key in asked[1:]), "the 3-sequence decode's shape was not asked for"
    finally:
        gate.set()
        llm.engine.background.close()


def test_the_compile_cache_lives_in_kestrels_cache_and_is_emptied_over_its_bound(tmp_path, monkeypatch):
    """Inductor's cache goes to $XDG_CACHE_HOME/kestrel/inductor unless TORCHINDUCTOR_CACHE_DIR says otherwise; one
    found over KESTREL_COMPILE_CACHE_GB at start-up is emptied (its entries refer to one another: none is removed
    alone), one under it is kept."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = use_compile_cache()
    assert folder == tmp_path / "kestrel" / "inductor" and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    (folder / "entry").mkdir()
    (folder / "entry" / "code.so").write_bytes(b"x" * 3000)
    monkeypatch.setenv("KESTREL_COMPILE_CACHE_GB", str(4000 / 2**30))
    assert use_compile_cache() == folder and cache_bytes(folder) == 3000
    monkeypatch.setenv("KESTREL_COMPILE_CACHE_GB", str(2000 / 2**30))
    assert use_compile_cache() == folder and folder.is_dir() and cache_bytes(folder) == 0
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert use_compile_cache() == tmp_path / "elsewhere"


def test_the_compiler_compiles_what_is_asked_once_in_order_and_stops_when_closed(caplog):
    """Each key compiles once however often it is asked, in the order asked, with no gradients; a failed compile is
    logged and its key never ready (its step stays eager); after close nothing queued is compiled."""
    compiler, done, gate, started = BackgroundCompiler(), [], threading.Event(), threading.Event()

    def compile(key):
        def run():
            started.set()
            gate.wait()
            assert not torch.is_grad_enabled()
            if key == "bad":
                raise RuntimeError("no C++ compiler")
            done.append(key)
        return run
    for key in ("a", "bad", "a", "b"):
        compiler.ask(key, compile(key))
    gate.set()
    assert compiler.wait_idle(10)
    assert done == ["a", "b"] and compiler.ready("a") and compiler.ready("b") and not compiler.ready("bad")
    assert "torch.compile of bad failed; that step stays eager: no C++ compiler" in caplog.text
    gate.clear()
    started.clear()
    compiler.ask("c", compile("c"))              # under way when closed: it finishes
    compiler.ask("d", compile("d"))              # queued: never compiled
    assert started.wait(10)
    compiler.close()
    gate.set()
    compiler._thread.join(10)
    assert not compiler._thread.is_alive() and done == ["a", "b", "c"]


@torch.inference_mode()
def test_the_prefill_chunk_terms_compiled_ahead_serve_later_prefills_without_compiling(torch_paths):
    """compile_chunk_terms (what the background compiler runs at start-up where the CPU kernels are off) traces the
    graph that later prefills of other lengths and sequence counts reuse: dynamo compiles nothing more for them, and
    they give the eager terms' outputs within float32's rounding (the compiled graph fuses the same float32
    operations)."""
    kda.compile_chunk_terms("aot_eager", 4, 48, 48)
    graphs = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(3)
    for tokens in (150, 300):
        q, k = (torch.nn.functional.normalize(torch.randn(tokens, 4, 48, generator=gen), dim=-1) for _ in range(2))
        v, g, beta = torch.randn(tokens, 4, 48, generator=gen), -torch.rand(tokens, 4, 48, generator=gen), \
            torch.rand(tokens, 4, generator=gen)
        lengths = torch.tensor([0, 100, tokens])
        with kda.compiled_chunk_terms("aot_eager"):
            compiled, _, _ = kda.chunk_kda(q, k, v, g, beta, lengths)
        eager, _, _ = kda.chunk_kda(q, k, v, g, beta, lengths)
        torch.testing.assert_close(compiled, eager)
    assert counters["stats"]["unique_graphs"] == graphs and "aot_eager" not in kda._failed_backends


@pytest.mark.parametrize("value", ["four", "-1", "nan"])
def test_a_compile_cache_bound_that_is_no_size_is_refused_in_one_sentence(value, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KESTREL_COMPILE_CACHE_GB", value)
    with pytest.raises(ValueError, match=r"^KESTREL_COMPILE_CACHE_GB must be a number of GB \(0 or more\), got"):
        use_compile_cache()
