"""`kestrel bench serve | card` and `kestrel eval perplexity | choice | generate`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from ..engine.args import BUNDLED_MODEL
from .agentic import AgenticShape
from .client import server_info
from .evals import DATA, EvalClient, choice, generate, perplexity, read_tasks
from .runner import RunConfig, run_sweep

HELDOUT_SAMPLE = BUNDLED_MODEL / "heldout_sample.txt"
"""The default text of `kestrel eval perplexity`: the bundled model's held-out sample (its model card's)."""
FILE_HELP = {
    "perplexity": "text to score; the default is the bundled model's held-out sample (Macbeth from the start of Act "
                  "I), on which its model card measures 71.94",
    "choice": 'JSONL tasks {"context", "choices", "answer"}; the default holds ten sample items, for smoke runs',
    "generate": 'JSONL tasks {"prompt", "answer"}; the default holds eight sample word problems, for smoke runs',
}


def add_commands(sub) -> None:
    bench = sub.add_parser("bench", help="serving benchmarks against any OpenAI-compatible server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    p = bench_sub.add_parser("serve", help="run a workload at one or more concurrencies")
    _server_args(p)
    p.add_argument("--workload", choices=["random", "agentic", "file"], default="random",
                   help="random: filler text of exact token lengths; agentic: AgentX-shaped chat sessions; file: "
                        "--file's prompts")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to measure (agentic: a cap)")
    p.add_argument("--max-concurrency", default="1", help="one value or a comma-separated sweep, e.g. 1,4,16")
    p.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    p.add_argument("--duration", type=float, default=None, help="stop dispatching after this many seconds")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests (not measured)")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs the server uses (for the per-GPU throughputs)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random and agentic workloads; each concurrency "
                                                       "level draws its own prompts from it and the level")
    p.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="random, file: output tokens")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths drawn from [L(1-r), L(1+r)]")
    p.add_argument("--file", type=Path, default=None, help="JSONL prompts for --workload file")
    p.add_argument("--sessions", type=int, default=16, help="agentic: sessions to generate")
    p.add_argument("--turns-median", type=int, default=6, help="agentic: median main-agent turns")
    p.add_argument("--length-scale", type=float, default=256.0, help="agentic: AgentX lengths divided by this")
    p.add_argument("--think-scale", type=float, default=1.0, help="agentic: multiplies think times")
    p.add_argument("--max-context", type=int, default=4096, help="agentic: keep prompts below this")
    p.add_argument("--output", type=Path, required=True, help="folder for the result JSONs and summary.md")
    p.set_defaults(run=_bench_serve)

    p = bench_sub.add_parser("card", help="Markdown card and PNG plots from result JSONs")
    p.add_argument("results", nargs="+", type=Path, help="result JSONs of `kestrel bench serve`")
    p.add_argument("--output", type=Path, required=True, help="folder for card.md and the plots")
    p.add_argument("--hardware", required=True, help="what the server ran on, e.g. '2-core x86 CPU'")
    p.add_argument("--recipe", required=True, help="how the server was launched")
    p.set_defaults(run=_bench_card)

    evals = sub.add_parser("eval", help="accuracy evals through the completions API")
    eval_sub = evals.add_subparsers(dest="eval_command", required=True)
    for name, default, helptext in (("perplexity", HELDOUT_SAMPLE, "perplexity of a text file"),
                                    ("choice", DATA / "choice_sample.jsonl", "multiple choice by log-likelihood"),
                                    ("generate", DATA / "generate_sample.jsonl", "exact-match generation tasks")):
        p = eval_sub.add_parser(name, help=helptext)
        _server_args(p)
        p.add_argument("--file", type=Path, default=default, help=FILE_HELP[name])
        p.set_defaults(run=_eval)


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")


def _quiet_http_log() -> None:
    """Keep httpx's INFO line per request out of the progress bars and results."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    return asyncio.run(server_info(args.base_url, args.api_key))["models"]["data"][0]["id"]


def _bench_serve(args: argparse.Namespace) -> int:
    _quiet_http_log()
    try:
        concurrencies = [int(c) for c in args.max_concurrency.split(",")]
    except ValueError:
        raise ValueError(f"--max-concurrency must be integers separated by commas, got {args.max_concurrency!r}.") \
            from None
    if args.workload == "file" and args.file is None:
        raise ValueError("--workload file needs --file PROMPTS.jsonl.")
    config = RunConfig(base_url=args.base_url, model=_model(args), workload=args.workload,
                       num_prompts=args.num_prompts, concurrency=concurrencies[0], request_rate=args.request_rate,
                       duration_s=args.duration, warmup=args.warmup, num_gpus=args.num_gpus, seed=args.seed,
                       api_key=args.api_key)
    shape = AgenticShape(sessions=args.sessions, turns_median=args.turns_median, length_scale=args.length_scale,
                         max_context=args.max_context, seed=args.seed)
    paths = run_sweep(config, concurrencies, args.output, sys.argv, input_len=args.input_len,
                      output_len=args.output_len, range_ratio=args.range_ratio, file=args.file, shape=shape,
                      think_scale=args.think_scale)
    print((args.output / "summary.md").read_text())
    print("\n".join(str(p) for p in paths))
    return 0


def _bench_card(args: argparse.Namespace) -> int:
    from .card import render_card     # matplotlib is slow to import; only the card needs it
    print(render_card(args.results, args.output, args.hardware, args.recipe))
    return 0


def _eval(args: argparse.Namespace) -> int:
    _quiet_http_log()
    client = EvalClient(args.base_url, _model(args), args.api_key)
    if args.eval_command == "perplexity":
        try:
            text = args.file.read_text()
        except OSError as e:
            raise ValueError(f"cannot read {args.file} ({e.strerror}).") from None
        result = perplexity(client, text)
    elif args.eval_command == "choice":
        result = choice(client, read_tasks(args.file))
    else:
        result = generate(client, read_tasks(args.file))
    print(json.dumps({"eval": args.eval_command, "file": str(args.file), **result}, indent=2))
    return 0
