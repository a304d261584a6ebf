"""The cookbook's subcommands of the `kestrel` command line: plan, recipe, verify, matrix, site.

`add_commands(subparsers)` registers them; each handler takes the parsed arguments and returns an exit code, and
raises ValueError (one sentence) for bad input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .calculator import (KV_DTYPE_CHOICES, KV_LAYOUTS, MODES, RADIX_STRATEGIES, SPEC_MODES, SSM_DTYPE_CHOICES,
                         CacheSettings)
from .evidence import DEFAULT_EVIDENCE_DIR, load_records
from .hardware import CPU, catalog, measure_cpu
from .layout import Layout
from .ledger import ledger_markdown, ledger_rows
from .matrix import matrix_markdown, matrix_rows
from .model import DTYPES, model_choices
from .planner import DEFAULT_BATCHES, ENGINES, HICACHE_CHOICES, PlanRequest, plan
from .publish import write_docs
from .recipe_request import QUANTS, STRATEGIES, RecipeRequest
from .recipes import base_requests, make_recipe
from .text import plan_text, recipe_text
from .verify import SmokeSettings, verify
from .web import build_site

AVG_REQUEST_LEN_HELP = "input + output tokens (default: SGLang's calculator's 11,264, or the model's context if less)"
EVIDENCE_DIR_HELP = "folder of the evidence records to read"
HICACHE_HELP = "hierarchical KV cache: off, host memory, or host memory and storage"
MOE_A2A_BACKENDS = ("none", "torch")
MOE_A2A_HELP = ("routed experts' tokens: none (every rank computes its experts' share of every token, one all-reduce "
                "over the TP group) or torch (each token dispatched all-to-all to the EP ranks holding its experts; "
                "dense MLPs and shared experts over the attention group; needs --ep above 1)")
LAYOUT_HELP = {"tp": "tensor-parallel size (ranks per pipeline stage)", "dp": "DP-attention size",
               "ep": "expert-parallel size", "pp": "pipeline-parallel stages", "dcp": "decode-context-parallel size"}


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register plan, recipe, verify, matrix and site on the `kestrel` subparsers."""
    _add_plan(subparsers)
    _add_recipe(subparsers)
    _add_verify(subparsers)
    _add_matrix(subparsers)
    _add_site(subparsers)


def _hardware_help() -> str:
    return f"one of: {', '.join([*catalog(), CPU])}"


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="memory plan, fit, concurrency and decode roofline of a deployment")
    p.add_argument("--model", default="k3", help=f"{', '.join(model_choices())}, or a config.json / model folder")
    p.add_argument("--hardware", default="b300", help=_hardware_help())
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: as many as the ranks need)")
    p.add_argument("--engine", choices=ENGINES, default="sglang",
                   help="whose pool arithmetic and sharding: SGLang's runtime, or kestrel's engine (what its ranks "
                        "allocate; TP and EP only)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="unquantized weights and activations")
    for name, text in LAYOUT_HELP.items():
        p.add_argument(f"--{name}", type=int, default=8 if name == "tp" else 1, help=text)
    p.add_argument("--moe-a2a-backend", choices=MOE_A2A_BACKENDS, default="none", help=MOE_A2A_HELP)
    p.add_argument("--ep-num-redundant-experts", type=int, default=0,
                   help="EPLB's extra routed-expert slots over the EP ranks (a multiple of --ep), counted in the "
                        "weights per rank and the all-to-all reach")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="bf16", help="KV cache element type")
    p.add_argument("--kv-layout", choices=KV_LAYOUTS, default="sglang",
                   help="SGLang's pools (fp8 with per-tensor scales; the DSA row for models with an indexer) or "
                        "kestrel's (fp8 with a scale per token and row)")
    p.add_argument("--ssm-dtype", choices=SSM_DTYPE_CHOICES, default="fp32",
                   help="linear-attention (SSM) state element type")
    p.add_argument("--spec", choices=SPEC_MODES, default="none", help="speculative decoding (mtp = DSPARK)")
    p.add_argument("--draft-tokens", type=int, default=0, help="draft block size (0: the draft model's)")
    p.add_argument("--draft-kv-bytes", type=int, default=None,
                   help="the draft's KV bytes per token (default: the draft model's)")
    p.add_argument("--replay-ssm", action="store_true",
                   help="--enable-linear-replayssm-spec (no verify states; a ring per state slot and "
                        "the conv verify windows per running request)")
    p.add_argument("--replay-cache-len", type=int, default=16, help="--linear-replayssm-cache-len (ring steps)")
    p.add_argument("--radix-strategy", choices=RADIX_STRATEGIES, default="extra_buffer",
                   help="--mamba-radix-cache-strategy (state slots a request holds for the radix cache)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="plan for SGLang's --disable-overlap-schedule")
    p.add_argument("--skip-decode-lock", action="store_true", help="SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1")
    p.add_argument("--mode", choices=MODES, default="unified", help="PD role")
    p.add_argument("--hicache", choices=HICACHE_CHOICES, default="off", help=HICACHE_HELP)
    p.add_argument("--avg-request-len", type=int, default=None, help=AVG_REQUEST_LEN_HELP)
    p.add_argument("--mem-fraction", type=float, default=0.85, help="--mem-fraction-static")
    p.add_argument("--ratio", type=float, default=None, help="pin --mamba-full-memory-ratio instead of balancing")
    p.add_argument("--max-running-requests", type=int, default=None, help="whole server (divided per DP worker)")
    p.add_argument("--max-mamba-cache-size", type=int, default=None,
                   help="pin the state slots (whole server, divided per DP worker) instead of the ratio")
    p.add_argument("--batch", default=",".join(map(str, DEFAULT_BATCHES)), help="roofline batch sizes, e.g. 1,64")
    p.add_argument("--context", type=int, default=None, help="roofline context length (default: --avg-request-len)")
    p.add_argument("--measure", action="store_true",
                   help="with --hardware cpu: measure this machine's memory bandwidth and float32 multiply rate now "
                        "(about a second, on torch's threads), so the roofline and the per-token costs have times")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_plan)


def _batches(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise ValueError(f"--batch must be comma-separated integers, got {text!r}.") from None


def plan_request(args: argparse.Namespace) -> PlanRequest:
    if args.measure and args.hardware != CPU:
        raise ValueError(f"--measure measures this machine: use it with --hardware {CPU}, not {args.hardware}.")
    cache = CacheSettings(kv_dtype=args.kv_dtype, kv_layout=args.kv_layout, ssm_dtype=args.ssm_dtype,
                          radix_strategy=args.radix_strategy, overlap_schedule=not args.disable_overlap_schedule,
                          skip_decode_lock=args.skip_decode_lock, mode=args.mode, spec=args.spec,
                          draft_tokens=args.draft_tokens, draft_kv_bytes=args.draft_kv_bytes,
                          replay_ssm=args.replay_ssm, replay_cache_len=args.replay_cache_len)
    return PlanRequest(model=args.model, hardware=args.hardware, dtype=args.dtype, engine=args.engine,
                       layout=Layout(tp=args.tp, dp=args.dp, ep=args.ep, pp=args.pp, dcp=args.dcp,
                                     a2a=args.moe_a2a_backend != "none",
                                     redundant_experts=args.ep_num_redundant_experts), nodes=args.nodes,
                       cache=cache, hicache=args.hicache, avg_request_len=args.avg_request_len,
                       mem_fraction=args.mem_fraction, ratio=args.ratio,
                       max_running_requests=args.max_running_requests,
                       max_mamba_cache_size=args.max_mamba_cache_size, batches=_batches(args.batch),
                       context=args.context, cpu_speed=measure_cpu() if args.measure else None)


def run_plan(args: argparse.Namespace) -> int:
    result = plan(plan_request(args))
    print(json.dumps(result.as_dict(), indent=2) if args.json else plan_text(result))
    return 0


def _add_recipe(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("recipe", help="launch commands for kestrel, SGLang and vLLM")
    p.add_argument("id", nargs="?", help="a recipe id (model/hardware/mode/strategy[,spec=..][,hicache=..]"
                                         "[,quant=..]); or use the flags below")
    p.add_argument("--model", default="k3", help=f"one of: {', '.join(model_choices())}")
    p.add_argument("--hardware", default="b300", help=_hardware_help())
    p.add_argument("--mode", choices=MODES, default="unified", help="PD role")
    p.add_argument("--strategy", choices=STRATEGIES, default="low-latency", help="what the launch is tuned for")
    p.add_argument("--spec", choices=SPEC_MODES, default="none", help="speculative decoding (mtp = DSPARK)")
    p.add_argument("--hicache", choices=HICACHE_CHOICES, default="off", help=HICACHE_HELP)
    p.add_argument("--quant", choices=QUANTS, default=None, help="default: the hardware's checkpoint")
    p.add_argument("--avg-request-len", type=int, default=None, help=AVG_REQUEST_LEN_HELP)
    p.add_argument("--list", action="store_true", help="list the recipe ids the anchors offer")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_recipe)


def recipe_request(args: argparse.Namespace) -> RecipeRequest:
    if args.id:
        return RecipeRequest.from_id(args.id, args.avg_request_len)
    return RecipeRequest(model=args.model, hardware=args.hardware, mode=args.mode, strategy=args.strategy,
                         spec=args.spec, hicache=args.hicache, quant=args.quant, avg_request_len=args.avg_request_len)


def run_recipe(args: argparse.Namespace) -> int:
    if args.list:
        print("\n".join(r.id for r in base_requests()))
        return 0
    recipe = make_recipe(recipe_request(args))
    print(json.dumps(recipe.as_dict(), indent=2) if args.json else recipe_text(recipe))
    return 0


def _add_verify(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("verify", help="run a recipe's smoke benchmark and accuracy check here; write evidence")
    p.add_argument("recipe", help="a recipe id, e.g. k3.1-tiny/cpu/unified/low-latency")
    defaults = SmokeSettings()
    p.add_argument("--requests", type=int, default=defaults.requests, help="concurrent requests in the benchmark")
    p.add_argument("--prompt-len", type=int, default=defaults.prompt_len, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="generated tokens per request")
    p.add_argument("--seed", type=int, default=defaults.seed,
                   help="seed of the random prompts (and of a random checkpoint's weights)")
    p.add_argument("--evidence-dir", type=Path, default=DEFAULT_EVIDENCE_DIR, help="folder to write the record into")
    p.add_argument("--allow-dirty", action="store_true",
                   help="run from a checkout with uncommitted changes; the record says it was dirty")
    p.set_defaults(run=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    settings = SmokeSettings(requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                             seed=args.seed)
    record = verify(args.recipe, settings, args.evidence_dir, args.allow_dirty)
    bench, accuracy = record.benchmark, record.accuracy
    print(f"wrote {record.path}")
    print(f"  {record.engine_args['model']}; {record.provenance}")
    print(f"  {bench['output_tokens_per_s']:.1f} output tok/s, {bench['total_tokens_per_s']:.1f} total tok/s at "
          f"concurrency {bench['concurrency']}; alone: TTFT {bench['ttft_s'] * 1e3:.0f} ms")
    print(f"  {record.accuracy_summary or 'no accuracy check (random weights): speed only'}")
    return 1 if accuracy and not accuracy["passed"] else 0


def _add_matrix(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("matrix", help="the verification matrix and claims ledger, from evidence records")
    p.add_argument("--evidence-dir", type=Path, default=DEFAULT_EVIDENCE_DIR, help=EVIDENCE_DIR_HELP)
    p.add_argument("--write", type=Path, default=None, metavar="DIR",
                   help="write matrix.md, claims.md, hardware.md and wide-ep.md into DIR (e.g. docs/cookbook)")
    p.set_defaults(run=run_matrix)


def run_matrix(args: argparse.Namespace) -> int:
    if args.write is not None:
        for path in write_docs(args.write, args.evidence_dir):
            print(f"wrote {path}")
        return 0
    records = load_records(args.evidence_dir)
    print(matrix_markdown(matrix_rows(records)))
    print(ledger_markdown(ledger_rows(records)))
    return 0


def _add_site(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("site", help="build the cookbook web page as static files")
    p.add_argument("--out", type=Path, required=True, help="folder to write")
    p.add_argument("--evidence-dir", type=Path, default=DEFAULT_EVIDENCE_DIR, help=EVIDENCE_DIR_HELP)
    p.set_defaults(run=run_site)


def run_site(args: argparse.Namespace) -> int:
    build_site(args.out, args.evidence_dir)
    print(f"wrote the cookbook page to {args.out}/index.html")
    return 0
