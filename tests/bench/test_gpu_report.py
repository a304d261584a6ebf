"""The GPU benchmark's reporting, which otherwise only runs on the GPU machine: its Markdown, its evidence record
(which must read back and reach the cookbook's matrix as "Runs", never "Verified": the weights are random), the
section of docs/benchmarks.md it writes, and its engine checks, run here on the CPU (graphs forced on, so each
replay runs the captured static step eagerly)."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.gpu import engine_checks, model, run, sizing
from benchmarks.gpu.sizing import GIB
from benchmarks.report import DOC
from kestrel.config import load_config
from kestrel.cookbook.evidence import read_record, write_record
from kestrel.cookbook.matrix import RUNS, matrix_rows
from kestrel.engine import engine as engine_module
from kestrel.engine.decode_graphs import DecodeGraphs
from kestrel.ops import backend

DECODE = [dict(batch=b, context=2048, eager_step_ms=e, step_ms=g, tokens_per_s=round(b / g * 1e3),
               bytes_per_step_gb=12.5, weights_gb=12.0, kv_gb=0.3, state_gb=0.2, bound_ms=2.9,
               eager_fraction_of_bound=round(2.9 / e, 3), fraction_of_bound=round(2.9 / g, 3))
          for b, e, g in ((1, 9.0, 4.0), (32, 12.0, 8.0), (128, 30.0, 25.0))]
DECODE[2] |= {"graph_error": "RuntimeError: capture failed", "step_ms": 30.0, "tokens_per_s": 4267,
              "fraction_of_bound": 0.097}
SEEDED = {"seed": 1234, "new_tokens": 32, "finish_reasons": {"alone": ["length"]}, "failed_runs": [],
          "same_seed_same_tokens": True, "other_seed_differs": True, "tokens": [5, 6], "passed": True}
GRAPH_ROWS = [{"batch": 1, "new_tokens": 48, "equal_requests": 1, "replays": 47, "widths": [2, 4],
               "first_mismatch": None, "max_logprob_diff": 0.0, "passed": True},
              {"batch": 2, "new_tokens": 48, "equal_requests": 1, "replays": 47, "widths": [4],
               "first_mismatch": {"request": 1, "token": 17}, "max_logprob_diff": 2.4e-07, "passed": False}]
RESULTS = {
    "environment": {"device": "NVIDIA H200", "started": "2026-11-30 05:00:00 UTC",
                    "versions": {"torch": "2.13.0", "triton": "3.9.0"}},
    "copy_bandwidth_gbps": 4300.0,
    "engine": {"seeded_sampling": SEEDED, "cuda_graphs": {"max_batch_size": 2, "rows": GRAPH_ROWS, "passed": False},
               "tensor_parallel": {"tp_size": 2, "requests": 4, "new_tokens": 16, "equal_requests": 4,
                                   "first_mismatch": None, "max_logprob_diff": 1e-06, "passed": True}},
    "kernels": [{"op": "kda_decode", "shape": "B=32", "triton_ms": 0.1, "torch_ms": 1.0, "speedup": 10.0,
                 "triton_gbps": 3000, "triton_tflops": 0.5, "max_rel_error": 1e-3}],
    "fla_prefill": {"skipped": "fla does not import here"},
    "model": {"sizing": {"experts": "bf16", "layers": 27, "full_layers": 27, "cut": False,
                         "described": "bf16 routed experts, all 27 layers", "weight_gb": 98.25, "cache_gb": 7.78,
                         "estimated_gb": 118.91},
              "backends": {"kda": "triton", "attention": "triton", "moe": "triton", "norm": "triton"},
              "parameters_b": 48.9, "peak_memory_gb": 110.0, "decode": DECODE,
              "verify": [{"batch": 1, "tokens_per_seq": 5, "verify_ms": 6.0, "decode_ms": 4.0,
                          "break_even_tokens": 1.5}],
              "prefill": {"sequences": 4, "length": 2048, "ms": 900.0, "tokens_per_s": 9102}, "left_out": []},
}
CACHE = dict(slots=model.CACHE_SLOTS, cache_tokens=model.CACHE_PAGES * model.PAGE_SIZE)


def test_markdown_has_eager_and_graph_decode_columns_and_graph_failures():
    text = run.markdown(RESULTS)
    assert "| batch | context | eager ms / step | graph ms / step |" in text
    assert "| 1 | 2048 | 9.0 | 4.0 | 250 | 12.5 | 2.9 | 0.322 | 0.725 |" in text
    assert "| 128 | 2048 | 30.0 | failed | 4267 | 12.5 | 2.9 | 0.097 | failed |" in text
    assert "- graphs at batch 128: RuntimeError: capture failed" in text
    assert "| 1 | 5 | 6.0 | 4.0 | 1.5 |" in text                # the verification against the decode step


def test_markdown_reports_the_engine_checks():
    text = run.markdown(RESULTS)
    assert ("Seeded sampling (seed 1234, temperature 1, 32 tokens): **passed**; runs that failed: none; "
            "the same tokens alone, again and among unseeded requests: yes; seed 1235 gives other tokens: yes.") in text
    assert "greedy, 48 tokens per request, prompts of different lengths: **failed**." in text
    assert "| batch | requests with equal tokens | graph replays | page-table widths captured |" in text
    assert "| 1 | 1/1 | 47 | 2, 4 | 0.0 | passed |" in text
    assert "| 2 | 1/2 | 47 | 4 | 2.4e-07 | FAILED |" in text
    assert "- batch 2: request 1 differs first at token 17" in text
    errors = {"seeded_sampling": {"error": "RuntimeError: Expected a 'cuda' device type for generator"},
              "cuda_graphs": {"skipped": "not run"}}
    text = run.markdown({**RESULTS, "engine": errors})
    assert "Seeded sampling: RuntimeError: Expected a 'cuda' device type for generator." in text
    assert "CUDA graphs against eager decode: not run." in text


def test_markdown_says_how_the_model_was_sized_and_what_the_time_budget_left_out():
    text = run.markdown(RESULTS)
    assert "Built with bf16 routed experts, all 27 layers: an estimated 118.91 GB on the device (98.25 GB of weights" \
        in text
    assert "copy bandwidth 4300.0 GB/s (read + write; h200 spec 4,800)" in text and "left out" not in text
    cut = {"experts": "mxfp4", "layers": 12, "full_layers": 27, "cut": True, "weight_gb": 13.0, "cache_gb": 3.0,
           "described": "mxfp4 routed experts, its first 12 of 27 layers (cut to fit the device)", "estimated_gb": 29.1}
    e2e = {**RESULTS["model"], "sizing": cut, "prefill": None, "left_out": ["verification at batch 32", "prefill"]}
    text = run.markdown({**RESULTS, "model": e2e})
    assert "Built with mxfp4 routed experts, its first 12 of 27 layers (cut to fit the device)" in text
    assert "Prefill:" not in text and "- left out (time budget): verification at batch 32, prefill" in text


def test_sizing_fits_one_h100_with_mxfp4_experts_and_an_h200_with_bf16():
    """98.24 GB of bf16 weights (`kestrel inspect kimi-linear-48b`) do not fit one H100's ~78 GiB: MXFP4 experts do,
    with room for the caches and the workspace; an H200's ~139 GiB holds the published bf16 model."""
    config = load_config(model.MODEL)
    h100 = sizing.choose(config, 78 * GIB, **CACHE)
    assert (h100.experts, h100.layers) == ("mxfp4", 27) and h100.fits(78 * GIB)
    assert h100.estimated_bytes <= sizing.USABLE_FRACTION * 78 * GIB
    assert h100.parameters > 48e9 and h100.weight_bytes < 30e9
    h200 = sizing.choose(config, 139 * GIB, **CACHE)
    assert (h200.experts, h200.layers) == ("bf16", 27) and h200.fits(139 * GIB)
    assert round(h200.weight_bytes / 1e9, 2) == 98.25 and h200.estimated_bytes > h100.estimated_bytes
    assert not h200.fits(78 * GIB)


def test_sizing_cuts_layers_to_fit_and_refuses_a_device_too_small():
    config = load_config(model.MODEL)
    small = sizing.choose(config, 24 * GIB, **CACHE)
    assert small.experts == "mxfp4" and small.layers < 27 and small.fits(24 * GIB)
    assert sizing.size(config, True, small.layers + 1, **CACHE).estimated_bytes > sizing.USABLE_FRACTION * 24 * GIB
    assert small.as_dict()["cut"]
    assert small.describe() == f"mxfp4 routed experts, its first {small.layers} of 27 layers (cut to fit the device)"
    with pytest.raises(ValueError, match=r"the smallest \(mxfp4 routed experts, its first 4 of 27 layers"):
        sizing.choose(config, 8 * GIB, **CACHE)


def test_a_device_too_small_records_the_sizing_error_instead_of_running_out_of_memory(monkeypatch):
    """The section measures the free memory before it builds anything; when nothing fits it records why and the
    model is never built."""
    monkeypatch.setattr(run.torch.cuda, "mem_get_info", lambda: (8 * GIB, 80 * GIB))
    monkeypatch.setattr(run.model, "run_model", lambda *args: pytest.fail("built a model that does not fit"))
    result = run.model_section(3000.0)
    assert result["error"].startswith("ValueError: no configuration of the model fits")
    assert result["error"] in run.markdown({**RESULTS, "model": result})
    assert run.model_section({"error": "RuntimeError: x"})["skipped"].startswith("no copy bandwidth")


def test_evidence_record_reads_back_into_the_matrix_as_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "fingerprint", lambda: ("h200", {"accelerators": ["NVIDIA H200"]}))
    path = write_record(run.evidence_record(RESULTS["model"], RESULTS["engine"]), tmp_path)
    record = read_record(path)
    assert record.recipe == "kimi-linear-48b/h200/unified/low-latency" and record.hardware_id == "h200"
    assert record.benchmark["output_tokens_per_s"] == 250 and record.benchmark["decode"] == DECODE
    assert record.benchmark["engine_checks"] == {"seeded_sampling_passed": True,
                                                 "cuda_graphs_equal_eager": {"1": True, "2": False},
                                                 "tp2_equals_one_process": True}
    assert record.accuracy is None and record.engine_args["cuda_graphs"]
    row = next(r for r in matrix_rows([record]) if r.recipe == record.recipe)
    assert row.badge == RUNS and row.summary.startswith("250.0 output tok/s at concurrency 1")


def test_the_script_writes_its_doc_section_from_results_or_says_not_measured(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- begin engine -->\nkept\n<!-- end engine -->\n")
    run.write_doc(None, doc)
    assert "kept" in doc.read_text() and "## GPU: not measured" in doc.read_text()
    results = tmp_path / "gpu-results.json"
    results.write_text(json.dumps(RESULTS))
    run.write_doc(results, doc)
    text = doc.read_text()
    assert "kept" in text and "not measured" not in text and run.markdown(RESULTS) in text


def test_the_committed_gpu_section_is_the_scripts():
    section = re.search(r"<!-- begin gpu -->\n(.*?)\n<!-- end gpu -->", DOC.read_text(), re.S).group(1)
    assert section == run.NOT_MEASURED or section.startswith("## GPU: the engine, Triton kernels")


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """The engine replays decode through DecodeGraphs on the CPU (each replay the static step, run eagerly)."""
    monkeypatch.setattr(engine_module, "graphs_supported", lambda device: True)
    yield
    backend.set_backend(None)


def test_seeded_sampling_check_on_the_cpu():
    result = engine_checks.seeded_sampling("cpu", new_tokens=6)
    assert result["passed"] and result["failed_runs"] == [] and len(result["tokens"]) == 6


def test_graph_check_on_the_cpu_compares_every_batch_size(graphs_on_cpu):
    result = engine_checks.graphs_against_eager("cpu", max_batch_size=4, new_tokens=3)
    assert result["passed"], result
    assert [r["batch"] for r in result["rows"]] == [1, 2, 4]
    for row in result["rows"]:                                          # token 0 comes from the prefill
        assert row["equal_requests"] == row["batch"] and row["replays"] == 2 and row["widths"]
        assert row["first_mismatch"] is None and row["max_logprob_diff"] < 1e-4


def test_graph_check_catches_a_corrupted_batch_of_one(graphs_on_cpu, monkeypatch):
    """Replays of one sequence return the logits shifted by one token: the check fails that batch size only."""
    replay = DecodeGraphs.run

    def corrupted(self, token_ids, *args):
        logits = replay(self, token_ids, *args)
        return logits.roll(1, dims=-1) if len(token_ids) == 1 else logits

    monkeypatch.setattr(DecodeGraphs, "run", corrupted)
    result = engine_checks.graphs_against_eager("cpu", max_batch_size=2, new_tokens=3)
    first, second = result["rows"]
    assert not result["passed"] and not first["passed"] and second["passed"]
    assert first["first_mismatch"] == {"request": 0, "token": 1}          # token 0 comes from the prefill


def test_graph_check_refuses_an_engine_without_graphs():
    with pytest.raises(RuntimeError, match="replays no decode from graphs"):
        engine_checks.graphs_against_eager("cpu", max_batch_size=1, new_tokens=2)


def test_tensor_parallel_check_on_the_cpu():
    """The check the GPU run records, on two CPU rank processes (gloo)."""
    result = engine_checks.tensor_parallel("cpu", new_tokens=3, requests=2)
    assert result["passed"], result
    assert result["equal_requests"] == 2 and result["first_mismatch"] is None
    assert result["max_logprob_diff"] < 0.1            # bf16 (the checkpoint's dtype): partials summed in another order
    assert "**passed**; 2/2 requests with equal tokens" in run.tp_markdown(result)
    assert run.tp_markdown({"error": "RuntimeError: x"}) == ("Tensor parallelism (TP2 against one process): "
                                                           "RuntimeError: x.")
