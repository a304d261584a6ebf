"""The `kestrel` command line: inspect a config, make a random checkpoint, quantize experts, generate greedily.

Bad input exits with status 2 and one sentence on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .config import ConfigError, load_config, parse_config
from .models.checkpoint import CheckpointError, build_model, load_model, save_model
from .models.generate import greedy_generate
from .models.init import init_weights
from .models.inspect import inspect_config
from .models.presets import PRESETS, tiny_config
from .models.quantize import quantize_experts


class UsageError(ValueError):
    """Bad command-line input."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, CheckpointError, UsageError) as e:
        print(f"kestrel {args.command}: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kestrel", description="Serve and study the Kimi K3 model family.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="parameter counts, active parameters and memory, from config.json alone")
    p.add_argument("model", help="model folder, config.json, or a published model: k3, k3.1-pro, kimi-linear-48b")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_inspect)

    p = sub.add_parser("random-model", help="write a checkpoint with random weights (for trying the stack)")
    p.add_argument("config", help=f"a preset ({', '.join(PRESETS)}) or a config.json / model folder")
    p.add_argument("--out", required=True, type=Path, help="folder to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(run=_random_model)

    p = sub.add_parser("quantize-experts", help="write a copy of a checkpoint with MXFP4 routed experts")
    p.add_argument("model", type=Path, help="model folder with unquantized experts")
    p.add_argument("--out", required=True, type=Path, help="folder to write")
    p.set_defaults(run=_quantize_experts)

    p = sub.add_parser("generate", help="greedy continuation of token ids")
    p.add_argument("--model", required=True, type=Path, help="model folder")
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids, e.g. 1,17,42")
    p.add_argument("--max-tokens", type=int, default=16)
    p.set_defaults(run=_generate)
    return parser


def _inspect(args: argparse.Namespace) -> int:
    config = load_config(args.model)
    report = inspect_config(config)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    rows = [
        ("architecture", report.architecture),
        ("layers", ", ".join(f"{v} {k}" for k, v in report.layers.items() if v)),
        ("total parameters", _count(report.total_params)),
        ("active parameters per token", _count(report.active_params)),
        ("embedding parameters", _count(report.embedding_params)),
        ("routed expert parameters", _count(report.routed_expert_params)),
    ]
    if report.mtp_params:
        rows.append(("MTP parameters", _count(report.mtp_params)))
    rows += [(f"weights in {fmt}", _bytes(n)) for fmt, n in report.weight_bytes.items()]
    rows += [("weights in all", _bytes(sum(report.weight_bytes.values()))),
             ("MLA cache per token (bf16)", f"{report.kv_bytes_per_token:,} B"),
             ("KDA state per sequence (fp32)", _bytes(report.state_bytes_per_sequence))]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit} ({n:,})"
    return f"{n:,}"


def _bytes(n: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _random_model(args: argparse.Namespace) -> int:
    raw = tiny_config(args.config) if args.config in PRESETS else None
    config = parse_config(raw) if raw is not None else load_config(args.config)
    needed = sum(inspect_config(config).weight_bytes.values())
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > available // 2:
        raise UsageError(f"this model needs {_bytes(needed)} of weights, more than half of this machine's "
                         f"{_bytes(available)} of memory; pick a smaller config.")
    model = init_weights(build_model(config, getattr(torch, args.dtype)), seed=args.seed)
    save_model(model, args.out, config_json=raw)
    print(f"wrote a random {config.architecture} checkpoint to {args.out}")
    return 0


def _quantize_experts(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    if model.config.experts_mxfp4:
        raise UsageError(f"{args.model} already stores its routed experts as MXFP4.")
    save_model(quantize_experts(model), args.out)
    print(f"wrote {args.out} with MXFP4 routed experts")
    return 0


def _generate(args: argparse.Namespace) -> int:
    try:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}.") from None
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}.")
    model = load_model(args.model)
    vocab = model.config.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise UsageError(f"--prompt-ids must lie in [0, {vocab}) for this model.")
    output = greedy_generate(model, [prompt], args.max_tokens, stop_token_id=model.config.eos_token_id)[0]
    print(",".join(map(str, output)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
