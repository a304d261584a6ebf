"""The GPU benchmark's reporting, which otherwise only runs on the GPU machine: its Markdown and its evidence record
(which must read back and reach the cookbook's matrix as "Runs", never "Verified": the weights are random)."""

from __future__ import annotations

from benchmarks.gpu import run
from kestrel.cookbook.evidence import read_record, write_record
from kestrel.cookbook.matrix import RUNS, matrix_rows

DECODE = [dict(batch=b, context=2048, eager_step_ms=e, step_ms=g, tokens_per_s=round(b / g * 1e3),
               bytes_per_step_gb=12.5, weights_gb=12.0, kv_gb=0.3, state_gb=0.2, bound_ms=2.9,
               eager_fraction_of_bound=round(2.9 / e, 3), fraction_of_bound=round(2.9 / g, 3))
          for b, e, g in ((1, 9.0, 4.0), (32, 12.0, 8.0), (128, 30.0, 25.0))]
DECODE[2] |= {"graph_error": "RuntimeError: capture failed", "step_ms": 30.0, "tokens_per_s": 4267,
              "fraction_of_bound": 0.097}
RESULTS = {
    "environment": {"device": "NVIDIA H200", "started": "2026-11-30 05:00:00 UTC",
                    "versions": {"torch": "2.13.0", "triton": "3.9.0"}},
    "copy_bandwidth_gbps": 4300.0,
    "kernels": [{"op": "kda_decode", "shape": "B=32", "triton_ms": 0.1, "torch_ms": 1.0, "speedup": 10.0,
                 "triton_gbps": 3000, "triton_tflops": 0.5, "max_rel_error": 1e-3}],
    "fla_prefill": {"skipped": "fla does not import here"},
    "model": {"backends": {"kda": "triton", "attention": "triton", "moe": "triton", "norm": "triton"},
              "parameters_b": 48.9, "peak_memory_gb": 110.0, "decode": DECODE,
              "prefill": {"sequences": 4, "length": 2048, "ms": 900.0, "tokens_per_s": 9102}},
}


def test_markdown_has_eager_and_graph_decode_columns_and_graph_failures():
    text = run.markdown(RESULTS)
    assert "| batch | context | eager ms / step | graph ms / step |" in text
    assert "| 1 | 2048 | 9.0 | 4.0 | 250 | 12.5 | 2.9 | 0.322 | 0.725 |" in text
    assert "| 128 | 2048 | 30.0 | failed | 4267 | 12.5 | 2.9 | 0.097 | failed |" in text
    assert "- graphs at batch 128: RuntimeError: capture failed" in text


def test_evidence_record_reads_back_into_the_matrix_as_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "fingerprint", lambda: ("h200", {"accelerators": ["NVIDIA H200"]}))
    path = write_record(run.evidence_record(RESULTS["model"]), tmp_path)
    record = read_record(path)
    assert record.recipe == "kimi-linear-48b/h200/unified/low-latency" and record.hardware_id == "h200"
    assert record.benchmark["output_tokens_per_s"] == 250 and record.benchmark["decode"] == DECODE
    assert record.accuracy is None and record.engine_args["cuda_graphs"]
    row = next(r for r in matrix_rows([record]) if r.recipe == record.recipe)
    assert row.badge == RUNS and row.summary.startswith("250.0 output tok/s at concurrency 1")
