"""The `kestrel` command line: inspect, random-model, quantize-experts, generate, serve, bench, eval, and the
cookbook's plan, recipe, verify, matrix and site.

Bad input exits with status 2 and one sentence on stderr.
"""

from __future__ import annotations

import argparse
import codecs
import json
import logging
import re
import sys
from pathlib import Path

import torch

from .bench.cli import add_commands as add_bench_commands
from .bench.client import ServerError
from .config import load_config, parse_config
from .cookbook.cli import add_commands as add_cookbook_commands
from .distributed.layout import ParallelLayout
from .distributed.parallel import Parallel
from .distributed.sharding import shard_bytes
from .engine.args import BUNDLED_MODEL, EngineArgs
from .engine.cache.planner import device_memory
from .engine.llm import LLM
from .engine.outputs import CompletionOutput
from .engine.ranks import is_rank_zero, run_node
from .engine.sampling import SamplingParams
from .models.checkpoint import build_model, load_model, save_model
from .models.init import init_weights
from .models.inspect import inspect_config
from .models.presets import PRESETS, tiny_config
from .models.quantize import quantize_experts
from .server.options import ServerOptions
from .server.dp import run_dp
from .server.router import run_router
from .server.serve import serve


class UsageError(ValueError):
    """Bad command-line input."""


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds each flag's default to its help, except where there is none to show (None, a switch's False, an empty
    list): there the help says what happens."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool) or action.default == []:
            return action.help
        return super()._get_help_string(action)


class KestrelParser(argparse.ArgumentParser):
    """An argument parser whose help shows defaults; subcommands' parsers are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0abfnrtv\\'\"])")


def unescape(text: str) -> str:
    """text with Python's backslash escapes (\\n, \\t, \\\\, \\xNN, \\uNNNN, ...) replaced by the characters they name;
    any other character, non-ASCII ones and unknown escapes included, as it is."""
    return ESCAPE.sub(lambda m: codecs.decode(m[0], "unicode_escape"), text)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["router"]:
        try:
            run_router(argv[1:])
        except ValueError as e:
            print(f"kestrel router: {e}", file=sys.stderr)
            return 2
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return args.run(args)
    except (ValueError, ServerError) as e:   # bad arguments or input; a benchmark's server that cannot be used
        print(f"kestrel {args.command}: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = KestrelParser(prog="kestrel", description="Serve and study the Kimi K3 model family.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="parameter counts, active parameters and memory, from config.json alone")
    p.add_argument("model", help="model folder, config.json, or a published model: k3, k3.1-pro, kimi-linear-48b")
    p.add_argument("--tp-size", type=int, default=1, help="also the weights each rank of this layout loads")
    p.add_argument("--ep-size", type=int, default=1, help="expert parallelism over the TP ranks")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline stages (each rank loads its stage's layers)")
    p.add_argument("--dp-size", type=int, default=1, help="DP attention groups of the TP ranks (--enable-dp-attention)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_inspect)

    p = sub.add_parser("random-model", help="write a checkpoint with random weights (for trying the stack)")
    p.add_argument("config", help=f"a preset ({', '.join(PRESETS)}) or a config.json / model folder")
    p.add_argument("--out", required=True, type=Path, help="folder to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype of the weights written")
    p.set_defaults(run=_random_model)

    p = sub.add_parser("quantize-experts", help="write a copy of a checkpoint with MXFP4 routed experts")
    p.add_argument("model", type=Path, help="model folder with unquantized experts")
    p.add_argument("--out", required=True, type=Path, help="folder to write")
    p.set_defaults(run=_quantize_experts)

    p = sub.add_parser("generate", help="generate text (or token ids) for one prompt or a JSONL file of prompts")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,17,42")
    source.add_argument("--input", type=Path, help='JSONL file, one {"prompt": ...} or {"prompt_token_ids": [...]} '
                                                    "per line")
    p.add_argument("--output", type=Path, help="JSONL file for the results of --input (default: stdout)")
    _add_sampling_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(run=_generate)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    ServerOptions.add_cli_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(run=_serve)
    p = sub.add_parser("router", help="SGLang's router in front of kestrel servers (flags as sglang_router's, e.g. "
                                      "--worker-urls URL URL, or --pd-disaggregation --prefill URL PORT --decode URL)",
                       add_help=False)
    p.set_defaults(run=None)      # main() hands every argument after "router" to the router unparsed
    add_bench_commands(sub)
    add_cookbook_commands(sub)
    return parser


def _serve(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli(args)
    if engine_args.dp_size > 1 and not engine_args.enable_dp_attention:
        if args.disaggregation_mode != "null" or engine_args.nnodes > 1:
            raise UsageError("--dp-size runs one node's unified instances; for PD or several nodes start each "
                             "instance yourself and put `kestrel router` in front.")
        return run_dp(args.argv[args.argv.index("serve") + 1:], engine_args.dp_size, args.host, args.port)
    if not is_rank_zero(engine_args):      # another node's ranks, or torchrun's: they serve rank 0's steps
        return run_node(engine_args)
    name = args.served_model_name
    if name is None:
        name = BUNDLED_MODEL.name if Path(args.model).resolve() == BUNDLED_MODEL else args.model
    return serve(engine_args, ServerOptions.from_cli(args, name), args.host, args.port)


def _rank_weight_bytes(config, tp: int, ep: int, pp: int, dp: int) -> list[int]:
    """Weight bytes each rank of a TP x EP x PP layout (with dp DP attention groups) loads, by the engine's sharding
    rules and its stages' modules (bfloat16 where unquantized)."""
    layout = ParallelLayout(tp, ep, 0, pp, dp_size=dp)
    layout.check_model(config)
    stages = [build_model(config, torch.bfloat16, "meta", Parallel.for_shapes(layout.with_rank(s * tp)))
              for s in range(pp)]
    return [shard_bytes(stages[r // tp], layout.with_rank(r)) for r in range(layout.world_size)]


def _inspect(args: argparse.Namespace) -> int:
    config = load_config(args.model)
    report = inspect_config(config)
    per_rank = _rank_weight_bytes(config, args.tp_size, args.ep_size, args.pp_size, args.dp_size) \
        if args.tp_size * args.pp_size > 1 else None
    if args.json:
        print(json.dumps({**report.as_dict(), **({"weight_bytes_per_rank": per_rank} if per_rank else {})}, indent=2))
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
    if per_rank:
        sizes = (("DP", args.dp_size), ("EP", args.ep_size), ("PP", args.pp_size))
        layout = f"TP{args.tp_size}" + "".join(f" x {name}{size}" for name, size in sizes if size > 1)
        rows.append((f"weights per rank ({layout})", ", ".join(_bytes(n) for n in per_rank)))
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
    available = device_memory(torch.device("cpu"))
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


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (vLLM's SamplingParams)")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per completion")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens with this "
                                                             "much probability")
    g.add_argument("--top-k", type=int, default=0, help="sample among this many most likely tokens; 0 is all")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the top one's")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="penalizes tokens already in the prompt or "
                                                                         "output; 1 is off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from the logits of tokens "
                                                                       "already generated")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted per occurrence from the logits "
                                                                        "of tokens already generated")
    g.add_argument("--seed", type=int, default=None, help="seed of this request's sampling (default: "
                                                          "--random-seed's stream)")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--stop", action="append", default=None, type=unescape,
                   help="a stop string, with backslash escapes as in Python ('\\n' is a newline, '\\\\' a "
                        "backslash); repeatable")
    g.add_argument("--stop-token-ids", default=None, help="comma-separated token ids that end a completion")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--logprobs", type=int, default=None, help="print each completion as JSON with the logprobs of "
                        "its tokens and of this many alternatives per position (vLLM's logprobs)")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop,
        stop_token_ids=_int_list(args.stop_token_ids, "--stop-token-ids") if args.stop_token_ids else None,
        ignore_eos=args.ignore_eos, max_tokens=args.max_tokens, logprobs=args.logprobs)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated integers, got {text!r}.") from None


def _read_prompts(path: Path) -> list[dict]:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        prompts = [json.loads(line) for line in lines]
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{path} is not a readable JSONL file ({e}).") from None
    if not prompts or not all(isinstance(p, dict) and ("prompt" in p or "prompt_token_ids" in p) for p in prompts):
        raise UsageError(f'every line of {path} must be a JSON object with "prompt" or "prompt_token_ids".')
    return [{k: p[k] for k in ("prompt", "prompt_token_ids") if k in p} for p in prompts]


def _generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    if args.input is not None:
        prompts = _read_prompts(args.input)
    elif args.prompt is not None:
        prompts = [{"prompt": args.prompt}]
    else:
        prompts = [{"prompt_token_ids": _int_list(args.prompt_ids, "--prompt-ids")}]
    engine_args = EngineArgs.from_cli(args)
    if not is_rank_zero(engine_args):
        return run_node(engine_args)
    llm = LLM(**vars(engine_args))
    try:
        results = llm.generate(prompts, params, use_tqdm=args.input is not None)
    finally:
        llm.engine.shutdown()          # the other ranks of a distributed instance exit with this one
    if args.input is None:
        for completion in results[0].outputs:
            text = completion.text if llm.engine.tokenizer is not None else ",".join(map(str, completion.token_ids))
            print(text if args.logprobs is None else json.dumps(_completion_record(completion)))
        return 0
    lines = [json.dumps({**prompt, "outputs": [_completion_record(c) for c in r.outputs]})
             for prompt, r in zip(prompts, results)]
    if args.output is None:
        print("\n".join(lines))
    else:
        args.output.write_text("\n".join(lines) + "\n")
    return 0


def _completion_record(c: CompletionOutput) -> dict:
    """A completion as JSON: its text, token ids and finish reason, and with --logprobs each position's
    {token id: logprob} (the sampled token and the top alternatives) and their cumulative logprob."""
    record = {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
    if c.logprobs is not None:
        record["cumulative_logprob"] = c.cumulative_logprob
        record["logprobs"] = [{str(token): p.logprob for token, p in position.items()} for position in c.logprobs]
    return record


if __name__ == "__main__":
    sys.exit(main())
