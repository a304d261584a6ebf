"""The benchmark card: Markdown plus PNG plots from result JSONs, stating the conditions of every point."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .runner import summary_markdown  # noqa: E402


def load_results(paths: list[Path]) -> list[dict]:
    results = []
    for path in paths:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not a benchmark result JSON ({e}).") from e
        if "metrics" not in results[-1] or "config" not in results[-1]:
            raise ValueError(f"{path} is not a kestrel benchmark result (no metrics/config).")
    return sorted(results, key=lambda r: (r["workload"]["name"], r["config"]["concurrency"]))


def render_card(paths: list[Path], out_dir: Path, hardware: str, recipe: str) -> Path:
    """Write card.md and its plots into out_dir; returns the Markdown path."""
    results = load_results(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = [_plot_throughput(results, out_dir), _plot_latency(results, out_dir), _plot_tradeoff(results, out_dir)]
    models = sorted({m["id"] for r in results for m in r["server_before"].get("models", {}).get("data", [])})
    conditions = [
        "| condition | value |", "|---|---|",
        f"| hardware | {hardware} |",
        f"| model | {', '.join(models) or 'unknown'} |",
        f"| recipe | {recipe} |",
        f"| server | {results[0]['config']['base_url']} |",
        f"| GPUs counted per point | {results[0]['config']['num_gpus']} |",
    ]
    workloads = sorted({json.dumps(r["workload"], sort_keys=True) for r in results})
    body = [
        "# Benchmark card", "",
        "Every point below was measured under these conditions.", "", *conditions, "",
        "Workloads:", "", *[f"- `{w}`" for w in workloads], "",
        summary_markdown(results).replace("# Benchmark summary\n", "## Results\n"),
        *[f"![{p.stem}]({p.name})" for p in plots], "",
        "Metric definitions follow vLLM's and SGLang's benchmark tools (TTFT, TPOT, ITL, E2E) and AgentX "
        "(total tokens/s per GPU over the first-start-to-last-end span; p90 interactivity = 1 / p90 TPOT).",
    ]
    card = out_dir / "card.md"
    card.write_text("\n".join(body) + "\n")
    return card


def _series(results: list[dict]) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = {}
    for r in results:
        series.setdefault(r["workload"]["name"], []).append(r)
    return series


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_throughput(results: list[dict], out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, points in _series(results).items():
        c = [p["config"]["concurrency"] for p in points]
        ax.plot(c, [p["metrics"]["output_throughput"] for p in points], "o-", label=f"{name}: output tok/s")
        ax.plot(c, [p["metrics"]["total_token_throughput_per_gpu"] for p in points], "s--",
                label=f"{name}: total tok/s/GPU")
    ax.set(xlabel="concurrency", ylabel="tokens / s", title="Throughput")
    ax.legend(fontsize=7)
    return _save(fig, out_dir / "throughput.png")


def _plot_latency(results: list[dict], out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, points in _series(results).items():
        c = [p["config"]["concurrency"] for p in points]
        for metric, style in (("ttft_s", "o-"), ("tpot_s", "s--")):
            values = [1000 * (p["metrics"][metric]["median"] or 0) for p in points]
            ax.plot(c, values, style, label=f"{name}: median {metric[:-2].upper()}")
    ax.set(xlabel="concurrency", ylabel="ms", title="TTFT and TPOT", yscale="log")
    ax.legend(fontsize=7)
    return _save(fig, out_dir / "latency.png")


def _plot_tradeoff(results: list[dict], out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, points in _series(results).items():
        per_user = [1 / p["metrics"]["tpot_s"]["median"] if p["metrics"]["tpot_s"]["median"] else 0 for p in points]
        per_gpu = [p["metrics"]["total_token_throughput_per_gpu"] for p in points]
        ax.plot(per_user, per_gpu, "o-", label=name)
        for p, x, y in zip(points, per_user, per_gpu):
            ax.annotate(f"c={p['config']['concurrency']}", (x, y), fontsize=7)
    ax.set(xlabel="tokens / s per user (1 / median TPOT)", ylabel="total tokens / s per GPU",
           title="Per-user speed against per-GPU throughput")
    ax.legend(fontsize=7)
    return _save(fig, out_dir / "tradeoff.png")
