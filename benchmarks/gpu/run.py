"""The one-command GPU benchmark: the serving engine's correctness checks on the bundled model (seeded sampling;
decode replayed from CUDA graphs against eager decode at every captured batch size, token for token; TP2 over two
rank processes, sharing the GPU when there is one, against one process), copy bandwidth, every Triton kernel against
its torch reference, KDA prefill against fla's chunk_kda (when fla imports), and end-to-end decode and prefill of a
Kimi-Linear-48B-shaped model with the fraction of the bandwidth bound reached, and a speculative verification's cost
against its decode step.

Budgeted for the device tool's default machine: one H100 80GB (~78 GiB usable), lent for 15 minutes of device time
in all, start-up included. So the script ends within about 7 minutes (no part starts after DEADLINE_S), leaving room
to run it once more. The end-to-end model is sized to the free memory it finds (benchmarks/gpu/sizing.py): on an
H100 its routed experts are MXFP4, as the K3 family ships them; an H200 (~139 GiB) holds them in bf16, as
Kimi-Linear-48B is published.

Writes $OUT/gpu-results.json (every number, the device, the software, any section's error), $OUT/gpu-results.md
(the section of docs/benchmarks.md) and, once decode of the whole model was measured, an evidence record under
$OUT/evidence/ (copy it to evidence/ to put it in the cookbook's matrix); OUT defaults to ./gpu-results. The first
two are rewritten after every section, so a run cut short keeps what it measured. Each section records its own
outcome: a failing case or section is recorded and the run goes on; sections that would start past their time
budget are recorded as skipped.

Run from the repository root: python3 benchmarks/gpu/run.py
Then, on any machine: python3 benchmarks/gpu/run.py --write-doc gpu-results/gpu-results.json writes the "gpu"
section of docs/benchmarks.md from those results (without a file, the section says the GPU is not measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu import engine_checks, kernels, model, sizing  # noqa: E402
from benchmarks.gpu.timing import copy_bandwidth_gbps  # noqa: E402
from benchmarks.report import DOC, markdown_table, write_section  # noqa: E402
from kestrel.config import load_config  # noqa: E402
from kestrel.cookbook.evidence import Record, fingerprint, git_state, now, software_versions, write_record  # noqa: E402
from kestrel.cookbook.hardware import device_for_cuda_name  # noqa: E402
from kestrel.ops import backend  # noqa: E402

START = time.monotonic()
KERNELS_UNTIL_S = 180
"""No kernel case starts after this many seconds, nor the fla comparison after KERNELS_UNTIL_S + 20; the engine
checks before them need about a minute."""
MODEL_UNTIL_S = 210
"""The end-to-end section starts only before this many seconds (it needs about three minutes)."""
DEADLINE_S = 390
"""No part of the end-to-end section after its first decode starts after this many seconds."""
COMMAND = "python3 benchmarks/gpu/run.py"
NOT_MEASURED = ("## GPU: not measured\n\n"
                "No GPU run has been made yet: no session with a GPU has run `{command}`, so this section has no "
                "numbers. That one command (about 7 minutes on one H100) checks the serving engine on the bundled "
                "model (seeded sampling on the GPU; decode replayed from CUDA graphs against eager decode at batch "
                "sizes 1, 2, 4, 8 and 16, token for token), measures the device's copy bandwidth, every Triton kernel "
                "against its torch reference (time, GB/s or TFLOP/s, error), KDA prefill against fla's `chunk_kda` "
                "where fla imports, and decode of a Kimi-Linear-48B-shaped model (random weights, routed experts in "
                "MXFP4 on an H100 and bf16 on an H200, context 2,048) "
                "at batch 1, 32 and 128, eagerly and from CUDA graphs, with the fraction of the bandwidth bound each "
                "reaches, plus prefill throughput; then `{command} --write-doc gpu-results/gpu-results.json` writes "
                "its tables here. Targets: decode at batch 1 at 80% or more of the bandwidth bound; KDA prefill at "
                "least as fast as fla.").format(command=COMMAND)


def elapsed() -> float:
    return time.monotonic() - START


def attempt(fn: Callable[[], Any]) -> Any:
    """fn()'s result, or {"error": ...} with the exception's last lines (the run goes on)."""
    try:
        return fn()
    except Exception as error:                       # noqa: BLE001 - recorded in the results, not hidden
        lines = traceback.format_exc().strip().splitlines()
        return {"error": f"{type(error).__name__}: {error}", "traceback": lines[-6:]}
    finally:
        torch.cuda.empty_cache()


def environment() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "fla"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"device": props.name, "multiprocessors": props.multi_processor_count,
            "memory_gb": round(props.total_memory / 1e9, 1), "versions": versions,
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def engine_section() -> dict[str, Any]:
    """The engine checks on the bundled model, each recorded (or its error) on its own."""
    checks = {"seeded_sampling": attempt(lambda: engine_checks.seeded_sampling("cuda")),
              "cuda_graphs": attempt(lambda: engine_checks.graphs_against_eager("cuda")),
              "tensor_parallel": attempt(lambda: engine_checks.tensor_parallel("cuda"))}
    backend.set_backend(None)                        # the engines chose backends process-wide; back to the default
    return checks


def kernel_rows() -> Iterator[dict[str, Any]]:
    """Each kernel case's results, in turn."""
    for make in kernels.all_cases():
        row = {"skipped": "time budget"} if elapsed() > KERNELS_UNTIL_S else attempt(lambda: kernel_row(make))
        print(json.dumps(row), flush=True)
        yield row


def kernel_row(make: Callable[[], kernels.Case]) -> dict[str, Any]:
    """One case's results, or its error under the case's name."""
    case = make()
    return {"op": case.op, "shape": case.label, **attempt(lambda: kernels.run_case(case))}


def fla_row() -> dict[str, Any]:
    if elapsed() > KERNELS_UNTIL_S + 20:
        return {"skipped": "time budget"}
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError as error:
        return {"skipped": f"fla does not import here ({error})"}
    return attempt(kernels.fla_prefill_row)


def model_sizing() -> sizing.Sizing:
    """The largest configuration of the model that fits the device's free memory now."""
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    sized = sizing.choose(load_config(model.MODEL), free, model.CACHE_SLOTS, model.CACHE_PAGES * model.PAGE_SIZE)
    print(f"end-to-end: {sized.describe()}, an estimated {sized.estimated_bytes / sizing.GIB:.1f} GiB of "
          f"{free / sizing.GIB:.1f} GiB free", flush=True)
    return sized


def model_section(bandwidth: float | dict[str, Any]) -> dict[str, Any]:
    """The end-to-end section: its sizing, then its results (or the error of either)."""
    if elapsed() > MODEL_UNTIL_S:
        return {"skipped": "time budget"}
    if isinstance(bandwidth, dict):
        return {"skipped": "no copy bandwidth to bound decode by (its measurement failed)"}
    sized = attempt(model_sizing)
    if not isinstance(sized, sizing.Sizing):
        return sized
    return {"sizing": sized.as_dict(), **attempt(lambda: model.run_model(bandwidth, sized, START + DEADLINE_S))}


def seeded_markdown(seeded: dict[str, Any]) -> str:
    """The seeded-sampling check in one paragraph."""
    if "passed" not in seeded:
        return f"Seeded sampling: {seeded.get('skipped') or seeded.get('error')}."
    how = (f"Seeded sampling (seed {seeded['seed']}, temperature 1, {seeded['new_tokens']} tokens): "
           f"**{'passed' if seeded['passed'] else 'failed'}**")
    failed = ", ".join(seeded["failed_runs"])
    return (f"{how}; runs that failed: {failed or 'none'}; the same tokens alone, again and among unseeded "
            f"requests: {'yes' if seeded['same_seed_same_tokens'] else 'no'}; seed {seeded['seed'] + 1} gives "
            f"other tokens: {'yes' if seeded['other_seed_differs'] else 'no'}.")


def engine_markdown(checks: dict[str, Any]) -> list[str]:
    """The engine checks' lines: seeded sampling, then graphs against eager per captured batch size."""
    lines = ["### Serving engine on the GPU (bundled k3.1-tiny)", "", seeded_markdown(checks["seeded_sampling"]), ""]
    graphs = checks["cuda_graphs"]
    if "rows" not in graphs:
        return lines + [f"CUDA graphs against eager decode: {graphs.get('skipped') or graphs.get('error')}."]
    rows = graphs["rows"]
    lines += [f"Decode replayed from CUDA graphs against eager decode (`--disable-cuda-graph`), greedy, "
              f"{rows[0]['new_tokens']} tokens per request, prompts of different lengths: "
              f"**{'passed' if graphs['passed'] else 'failed'}**.", "", markdown_table(
                  ["batch", "requests with equal tokens", "graph replays", "page-table widths captured",
                   "max logprob diff", "verdict"],
                  [[r["batch"], f"{r['equal_requests']}/{r['batch']}", r["replays"],
                    ", ".join(map(str, r["widths"])), r["max_logprob_diff"], "passed" if r["passed"] else "FAILED"]
                   for r in rows])]
    lines += [f"- batch {r['batch']}: request {r['first_mismatch']['request']} differs first at token "
              f"{r['first_mismatch']['token']}" for r in rows if r["first_mismatch"]]
    return lines + ["", tp_markdown(checks.get("tensor_parallel", {"skipped": "not run"}))]


def tp_markdown(tp: dict[str, Any]) -> str:
    """The tensor-parallel check in one paragraph."""
    if "passed" not in tp:
        return f"Tensor parallelism (TP2 against one process): {tp.get('skipped') or tp.get('error')}."
    mismatch = tp["first_mismatch"]
    return (f"Tensor parallelism, TP2 (two rank processes) against one process, greedy, {tp['new_tokens']} tokens "
            f"per request: **{'passed' if tp['passed'] else 'failed'}**; {tp['equal_requests']}/{tp['requests']} "
            f"requests with equal tokens, max logprob diff {tp['max_logprob_diff']}"
            + (f"; request {mismatch['request']} differs first at token {mismatch['token']}." if mismatch else "."))


def bandwidth_text(device_name: str, measured: float | dict[str, Any]) -> str:
    """The measured copy bandwidth (or its error) beside the catalog's specification of the device."""
    if isinstance(measured, dict):
        return f"copy bandwidth not measured ({measured.get('error')})"
    device = device_for_cuda_name(device_name)
    spec = device.bandwidth_bytes_per_s if device else None
    return f"copy bandwidth {measured} GB/s (read + write" + (f"; {device.id} spec {spec / 1e9:,.0f})" if spec else ")")


def sizing_text(sized: dict[str, Any]) -> str:
    """What the end-to-end section built, as benchmarks/gpu/sizing.py chose it."""
    return (f"Built with {sized['described']}: an estimated {sized['estimated_gb']} GB on the device "
            f"({sized['weight_gb']} GB of weights, {sized['cache_gb']} GB of caches, the rest workspace; chosen by "
            "benchmarks/gpu/sizing.py from the free memory).")


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [f"## GPU: the engine, Triton kernels and end-to-end decode ({env['device']})", "",
             f"{env['started']}; torch {env['versions']['torch']}, triton {env['versions']['triton']}; "
             f"{bandwidth_text(env['device'], results['copy_bandwidth_gbps'])}. "
             f"Rerun: `{COMMAND}`, then `{COMMAND} --write-doc gpu-results/gpu-results.json`.", ""]
    lines += engine_markdown(results["engine"])
    done = [r for r in results["kernels"] if "triton_ms" in r]
    lines += ["", "### Kernels against the torch reference", "", markdown_table(
        ["op", "shape", "triton ms", "torch ms", "speedup", "GB/s", "TFLOP/s", "max rel. error"],
        [[r["op"], r["shape"], r["triton_ms"], r["torch_ms"], f"{r['speedup']}x", r["triton_gbps"],
          r["triton_tflops"], r["max_rel_error"]] for r in done])]
    errors = [r for r in results["kernels"] if "error" in r]
    lines += [f"- {r.get('op', 'a case')} {r.get('shape', '')}: {r['error']}" for r in errors]
    skipped = sum("skipped" in r for r in results["kernels"])
    lines += [f"- {skipped} more cases skipped (time budget)"] if skipped else []
    fla = results["fla_prefill"]
    lines += ["", "### KDA prefill against fla's chunk_kda", ""]
    if "fla_ms" in fla:
        lines.append(markdown_table(["shape", "kestrel ms", "fla ms", "kestrel vs fla", "max rel. diff"],
                                    [[fla["shape"], fla["kestrel_ms"], fla["fla_ms"], f"{fla['kestrel_vs_fla']}x",
                                      fla["max_rel_diff"]]]))
    else:
        lines.append(f"- {fla.get('skipped') or fla.get('error')}")
    e2e = results["model"]
    lines += ["", "### End-to-end decode (Kimi-Linear-48B shape, random weights)", ""]
    lines += [sizing_text(e2e["sizing"]), ""] if "sizing" in e2e else []
    if "decode" not in e2e:
        return "\n".join(lines + [f"- {e2e.get('skipped') or e2e.get('error')}"])
    lines += [f"Backends that ran: {', '.join(f'{k} {v}' for k, v in e2e['backends'].items())}; "
              f"{e2e['parameters_b']}B parameters; peak memory {e2e['peak_memory_gb']} GB.", "", markdown_table(
                  ["batch", "context", "eager ms / step", "graph ms / step", "tokens / s (graph)", "GB moved / step",
                   "bound ms", "fraction of bound (eager)", "fraction of bound (graph)"],
                  [[d["batch"], d["context"], d["eager_step_ms"], "failed" if "graph_error" in d else d["step_ms"],
                    d["tokens_per_s"], d["bytes_per_step_gb"], d["bound_ms"], d["eager_fraction_of_bound"],
                    "failed" if "graph_error" in d else d["fraction_of_bound"]] for d in e2e["decode"]]), ""]
    lines += [f"- graphs at batch {d['batch']}: {d['graph_error']}" for d in e2e["decode"] if "graph_error" in d]
    if e2e.get("verify"):
        lines += ["Speculative verification (eager, every token's KDA state kept) against the decode step above: a "
                  "verification pays only where it emits more tokens than break-even, plus the draft's own time. "
                  "Random weights have no acceptance to measure (the bundled model's block draft emits 3.0 tokens "
                  "per verification on held-out text, docs/benchmarks.md spec).", "", markdown_table(
                      ["batch", "tokens / sequence", "verify ms", "decode ms", "break-even tokens / verification"],
                      [[v["batch"], v["tokens_per_seq"], v["verify_ms"], v["decode_ms"], v["break_even_tokens"]]
                       for v in e2e["verify"]]), ""]
    p = e2e["prefill"]
    lines += [f"Prefill: {p['sequences']} x {p['length']} tokens in {p['ms']} ms, {p['tokens_per_s']} tokens/s."] \
        if p else []
    lines += [f"- left out (time budget): {', '.join(e2e['left_out'])}"] if e2e["left_out"] else []
    return "\n".join(lines)


def evidence_record(e2e: dict[str, Any], checks: dict[str, Any]) -> Record:
    """The end-to-end section as an evidence record of the Kimi-Linear-48B low-latency lane on this GPU: speed at
    batch 1 (the whole decode table and the prefill inside), with the engine checks' verdicts. Random weights, so
    no accuracy check: the matrix shows "Runs", never "Verified"."""
    hardware_id, hardware = fingerprint()
    single = e2e["decode"][0]
    return Record(
        recipe=f"{model.MODEL}/{hardware_id}/unified/low-latency", hardware_id=hardware_id, hardware=hardware,
        software=software_versions(), git=git_state(), command="python3 benchmarks/gpu/run.py", created=now(),
        engine_args={"model": f"random {model.MODEL}-shaped weights ({e2e['sizing']['experts']} routed experts)",
                     "device": "cuda", "page_size": model.PAGE_SIZE, "cuda_graphs": "graph_error" not in single,
                     "backends": e2e["backends"]},
        benchmark={"workload": {"decode_context": single["context"], "batch": single["batch"],
                                "steps": model.DECODE_STEPS, "weights": "random"},
                   "output_tokens_per_s": single["tokens_per_s"], "concurrency": single["batch"],
                   "tpot_s": single["step_ms"] / 1e3, "fraction_of_bound": single["fraction_of_bound"],
                   "decode": e2e["decode"], "prefill": e2e["prefill"],
                   "engine_checks": engine_checks.summary(checks)},
        accuracy=None)


def save(results: dict[str, Any], out: Path) -> None:
    results["seconds"] = round(elapsed(), 1)
    (out / "gpu-results.json").write_text(json.dumps(results, indent=2))
    (out / "gpu-results.md").write_text(markdown(results) + "\n")


def write_doc(results_path: Path | None, doc: Path = DOC) -> None:
    """Write the "gpu" section of docs/benchmarks.md: a run's tables, or, without results, that none was made."""
    write_section("gpu", markdown(json.loads(results_path.read_text())) if results_path else NOT_MEASURED, doc)


def measure() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/run.py needs a CUDA device; run it on the GPU machine.")
    out = Path(os.environ.get("OUT") or "gpu-results")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"environment": environment(), "kernels": [], "fla_prefill": {"skipped": "not run"},
                               "model": {"skipped": "not run"},
                               "engine": {"seeded_sampling": {"skipped": "not run"},
                                          "cuda_graphs": {"skipped": "not run"},
                                          "tensor_parallel": {"skipped": "not run"}}}
    bandwidth = attempt(copy_bandwidth_gbps)
    results["copy_bandwidth_gbps"] = bandwidth if isinstance(bandwidth, dict) else round(bandwidth, 1)
    print(f"copy bandwidth (GB/s): {json.dumps(results['copy_bandwidth_gbps'])}", flush=True)
    save(results, out)
    results["engine"] = engine_section()
    print(json.dumps(results["engine"]), flush=True)
    save(results, out)
    for row in kernel_rows():
        results["kernels"].append(row)
        save(results, out)
    results["fla_prefill"] = fla_row()
    print(json.dumps(results["fla_prefill"]), flush=True)
    save(results, out)
    results["model"] = model_section(results["copy_bandwidth_gbps"])
    print(json.dumps(results["model"]), flush=True)
    save(results, out)
    if "decode" in results["model"] and not results["model"]["sizing"]["cut"]:
        record = evidence_record(results["model"], results["engine"])
        print(f"evidence: {write_record(record, out / 'evidence')}", flush=True)
    print(f"done in {results['seconds']} s; results in {out}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-doc", nargs="?", const="", metavar="RESULTS", type=str,
                        help="write docs/benchmarks.md's gpu section from a run's gpu-results.json (without a file: "
                             "that no GPU run has been made) instead of measuring")
    args = parser.parse_args(argv)
    if args.write_doc is None:
        measure()
    else:
        write_doc(Path(args.write_doc) if args.write_doc else None)


if __name__ == "__main__":
    main()
