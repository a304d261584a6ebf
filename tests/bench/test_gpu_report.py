"""The GPU benchmark's reporting, which otherwise only runs on the GPU machine: its Markdown, its evidence record
(which must read back and reach the cookbook's matrix as "Runs", never "Verified": the weights are random), the
section of docs/benchmarks.md it writes, and its engine checks, run here on the CPU (graphs forced on, so each
replay runs the captured static step eagerly)."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.gpu import engine_checks, run
from benchmarks.report import DOC
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
    "model": {"backends": {"kda": "triton", "attention": "triton", "moe": "triton", "norm": "triton"},
              "parameters_b": 48.9, "peak_memory_gb": 110.0, "decode": DECODE,
              "verify": [{"batch": 1, "tokens_per_seq": 5, "verify_ms": 6.0, "decode_ms": 4.0,
                          "break_even_tokens": 1.5}],
              "prefill": {"sequences": 4, "length": 2048, "ms": 900.0, "tokens_per_s": 9102}},
}


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
    assert "kept" in doc.read_text() and "## GPU (one H200): not measured" in doc.read_text()
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
