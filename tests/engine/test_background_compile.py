"""Compiling in the background (the CPU's default, kestrel.engine.background_compile): the engine serves a step
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
from test_decode_graphs import (FLOAT32_STEP_BOUND, PROMPTS, SEQ_SLOTS, SLOTS, assert_float32_of, page_table,
                                prefilled_cache)

CPU = torch.device("cpu")


@pytest.fixture
def restore_backends():
    yield
    backend.set_backend(None)


def test_the_compile_flags_choose_how_cpu_steps_compile(monkeypatch):
    """Background by default on the CPU; --enable-torch-compile in the foreground; --disable-torch-compile (or
    KESTREL_DISABLE_TORCH_COMPILE=1, which only changes the default) eagerly; never off the CPU; both flags refused."""
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)

    def mode(*flags: str, device: torch.device = CPU) -> str | None:
        return EngineArgs.from_cli(parser.parse_args(list(flags))).torch_compile(device)

    monkeypatch.delenv("KESTREL_DISABLE_TORCH_COMPILE", raising=False)
    assert mode() == "background"
    assert mode("--enable-torch-compile") == "foreground"
    assert mode("--disable-torch-compile") is None
    assert mode(device=torch.device("cuda")) is None
    monkeypatch.setenv("KESTREL_DISABLE_TORCH_COMPILE", "1")
    assert mode() is None and mode("--enable-torch-compile") == "foreground"
    with pytest.raises(ValueError, match="disable_torch_compile must be left unset with --enable-torch-compile"):
        EngineArgs(model="m", enable_torch_compile=True, disable_torch_compile=True)


@torch.inference_mode()
def test_a_step_compiled_in_the_background_equals_the_eager_step(restore_backends):
    """While a padded step (3 sequences in a graph of 4) compiles on the compiler's thread, the engine thread runs
    the same step eagerly, again and again, with the same results (fx's tracing, which patches torch.nn.Module for
    the whole process, waits for each, and torch.compiler.is_compiling's process-wide flag changes no path); once
    compiled, the graph gives the float64 step's logits within float32's bound, called with the engine's own cache
    without compiling again, and the background compile left the engine's per-layer state objects alone."""
    backend.set_backend("torch")
    model, _ = tiny_model("k3.1-tiny", num_experts=16)
    reference = copy.deepcopy(model).double()
    cache = prefilled_cache(model)
    exact = DecodeGraphs(reference, prefilled_cache(reference, dtype=torch.float64), page_table(), max_batch_size=4,
                         scratch_slot=SLOTS - 1)
    ids, prefix = [1, 2, 3], [len(p) for p in PROMPTS]
    expected = exact.run(ids, prefix, SEQ_SLOTS, 4).logits.clone()
    compiler = BackgroundCompiler()
    graphs = DecodeGraphs(model, cache, page_table(), max_batch_size=4, scratch_slot=SLOTS - 1, compile="aot_eager",
                          background=compiler)
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
    """By default (on the CPU) the engine asks at start-up for the KDA prefill's chunk terms and the batch-1 decode
    step, and for every new decode shape as it comes; while those compiles are held up, requests of new shapes are
    prefilled and decoded eagerly, to the tokens (and logprobs, within float32's bound) of an engine that never
    compiles."""
    gate, asked, ask = threading.Event(), [], BackgroundCompiler.ask
    monkeypatch.setattr(BackgroundCompiler, "ask", lambda self, key, compile: (asked.append(key),
                                                                                ask(self, key, gate.wait)))
    prompts = [{"prompt_token_ids": [5 + i, 9, 14, 3] * (1 + 40 * i)} for i in range(3)]   # 4 to 324 tokens
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    eager = [o.outputs[0] for o in LLM(str(model_dir), page_size=4, disable_torch_compile=True).generate(prompts,
                                                                                                         params)]
    monkeypatch.delenv("KESTREL_DISABLE_TORCH_COMPILE", raising=False)
    llm = LLM(str(model_dir), page_size=4)
    try:
        engine = llm.engine
        assert engine.background is not None and engine.runner.prefill_compile == "inductor"
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
        # the eager path on weights laid out for the compiled steps (row-major: other summation orders than the
        # column-major layout of an engine that never compiles), within float32's bound for a step
        got, want = (torch.tensor([[next(iter(step.values())).logprob for step in o.logprobs] for o in run])
                     for run in (outputs, eager))
        torch.testing.assert_close(got, want, rtol=0, atol=FLOAT32_STEP_BOUND * float(want.abs().max()))
        assert not engine.background.ready(PREFILL_TERMS) and not engine.runner.decode_graphs.steps
        assert asked[:2] == [PREFILL_TERMS, ("decode step", 1, 1, 1)]
        assert any(key[1] == 4 for key in asked[2:]), "the 3-sequence decode's shape was not asked for"
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
