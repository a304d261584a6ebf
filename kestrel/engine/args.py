"""Engine arguments, named as SGLang names them so that users can carry their launch settings over."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..models.dflash_draft import is_dflash_draft, is_dspark_draft
from ..ops import cpu
from ..ops.backend import CHOICES, FAMILIES, set_backend

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SSM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "models" / "k3.1-tiny"
"""The model kestrel ships (trained by tools/train_tiny.py): the default of `kestrel serve` and `kestrel generate`."""
MODEL_DRAFTERS = ("NEXTN", "DFLASH")
"""The speculative algorithms whose drafters read the target's final hidden states."""
HELP = {
    "model": "model folder",
    "dtype": "weights and activations: auto (the checkpoint's; float32 on the CPU, whose kernels compute in "
             "float32), float32 or bfloat16",
    "device": "cpu or cuda",
    "mem_fraction_static": "share of the device's memory for the weights and both pools (default: 0.85 on CUDA, "
                           "0.1 of RAM on CPU)",
    "mamba_full_memory_ratio": "split of the memory the weights leave, as KDA state : KV",
    "max_mamba_cache_size": "KDA state slots (default: sized by --mamba-full-memory-ratio)",
    "max_total_tokens": "cap on the KV pool, in tokens (default: what memory allows)",
    "mamba_ssm_dtype": "KDA recurrent state: float32 or bfloat16",
    "kv_cache_dtype": "MLA latent cache: auto (the model's dtype), bfloat16 or fp8_e4m3",
    "max_running_requests": "most sequences decoding at once (default: what the pools allow)",
    "page_size": "tokens per KV page",
    "context_length": "longest sequence (default: the model's max_position_embeddings, capped by the KV pool); above the "
                      "trained length too (the family has no RoPE), refused at start-up when the KV pool cannot hold it",
    "max_prompt_tokens": "longer prompts are refused (default: the context length)",
    "chunked_prefill_size": "most prompt tokens of one request per step",
    "max_prefill_tokens": "most tokens (prefill and decode) in one step",
    "max_decode_stall_ms": "while sequences decode, a step takes only the prompt tokens that keep it about this "
                           "long, at the costs measured over recent steps (at least 32 tokens); 0: no bound but "
                           "--max-prefill-tokens",
    "random_seed": "seeds the sampling of requests that set no seed of their own",
    "attention_backend": "MLA decode and the indexer: auto (Triton on CUDA), torch or triton",
    "moe_backend": "routed experts: auto, torch or triton",
    "kda_backend": "KDA decode and prefill over the state pool: auto, torch or triton",
    "norm_backend": "AttnRes mix + RMSNorm: auto, torch or triton",
    "moe_mxfp8_activations": "round routed-expert GEMM inputs to MXFP8 (W4A8, as K3's QAT)",
    "moe_dense_experts": "CPU: keep a dense copy of MXFP4 experts: none, bfloat16 or float32",
    "moe_onednn_experts": "CPU: hold float32 experts again in oneDNN's packed layout (+4 B per weight)",
    "disable_radix_cache": "prefix caching off: every prompt computed from its first token",
    "mamba_scheduler_strategy": "where prefix-cache KDA state snapshots are taken: no_buffer or extra_buffer",
    "mamba_track_interval": "extra_buffer: a snapshot every this many decode tokens",
    "enable_hierarchical_cache": "evicted prefix-cache entries spill to host memory, then storage",
    "hicache_ratio": "host tier size as a multiple of the device caches",
    "hicache_size": "host tier size in GB; above 0 it overrides --hicache-ratio",
    "hicache_storage_backend": "third tier: none or file",
    "hicache_storage_dir": "the file backend's directory",
    "tp_size": "tensor parallelism: ranks per model replica",
    "ep_size": "expert parallelism over the TP ranks",
    "dp_size": "data parallelism: instances behind SGLang's router, or attention groups with --enable-dp-attention",
    "enable_dp_attention": "split attention and its caches into --dp-size groups of the TP ranks",
    "moe_a2a_backend": "routed experts' tokens: none (every rank computes its experts' share of every token, one "
                       "all-reduce) or torch (each token dispatched all-to-all to the ranks holding its experts, "
                       "torch.distributed; the residual stream stays with its DP attention group)",
    "enable_eplb": "expert-parallel load balancing: re-place the routed experts (and their redundant copies) by "
                   "their measured load every --eplb-rebalance-num-iterations steps",
    "ep_num_redundant_experts": "extra routed-expert slots over the EP ranks, holding copies of hot experts",
    "eplb_rebalance_num_iterations": "steps between two EPLB rebalances (the load is counted over them)",
    "dcp_size": "decode context parallelism: ranks of a TP group splitting the MLA cache by position",
    "pp_size": "pipeline stages",
    "nnodes": "machines one instance runs on",
    "node_rank": "this machine's index among --nnodes",
    "dist_init_addr": "HOST:PORT of rank 0's rendezvous (several machines)",
    "speculative_algorithm": "none, NGRAM (earlier tokens), NEXTN (the MTP layer), DFLASH (a block draft), DSPARK "
                             "or STANDALONE (a smaller model sharing the tokenizer)",
    "speculative_num_draft_tokens": "draft tokens verified per step",
    "speculative_disable_by_batch_size": "draft only while at most this many sequences run (default: always)",
    "speculative_draft_min_confidence": "DFLASH: cut blocks where the drafts' probability product falls below this",
    "speculative_draft_model_path": "DFLASH, DSPARK: the draft's folder; STANDALONE: the draft model's",
    "speculative_token_map": "NEXTN, DFLASH: a file of token ids the drafts are chosen among (FR-Spec)",
    "disable_cuda_graph": "decode eagerly even where CUDA graphs could replay it",
    "disable_cpu_kernels": "CPU: compute with torch's own kernels only (the reference), not kestrel's C++ kernels "
                           "(products of up to 4 rows, routed experts, the KDA state step, AttnRes's mix, the "
                           "indexer's top-k); for debugging: served decode 1.4-2.9x slower",
    "cuda_graph_max_bs": "largest decode batch replayed from a CUDA graph (bigger ones run eagerly)",
    "enable_torch_compile": "CPU: compile decode steps and the KDA prefill's chunk terms with torch.compile, each "
                            "shape's graph when first needed (a step waits for it: tens of seconds); the code is "
                            "cached in $TORCHINDUCTOR_CACHE_DIR (default ~/.cache/kestrel/inductor)",
    "enable_background_compile": "CPU, experimental: compile the same in the background, the steps running eagerly "
                                 "until their graph is ready (README: what it costs while compiling)",
    "torch_compile_max_bs": "largest decode batch run compiled (bigger ones run eagerly)",
    "enable_deterministic_inference": "a request's tokens and logprobs bit for bit the same however it is batched "
                                      "(CPU, one rank, eager; docs/benchmarks.md: what it costs)",
}
"""The one-line --help of each engine flag (EngineArgs' fields)."""


@dataclass
class EngineArgs:
    """How the engine loads the model, sizes its pools and schedules.

    Memory follows SGLang: `mem_fraction_static` of the device's memory holds the weights and both pools; what
    the weights leave is split between KDA state and KV in the ratio `mamba_full_memory_ratio` (state : KV), unless
    `max_mamba_cache_size` fixes the number of state slots.
    """

    model: str
    dtype: str = "auto"                          # auto (the checkpoint's; float32 on the CPU), float32, bfloat16
    device: str = "cpu"
    mem_fraction_static: float | None = None     # default: 0.85 on CUDA, 0.1 of RAM on CPU
    mamba_full_memory_ratio: float = 0.9
    max_mamba_cache_size: int | None = None
    max_total_tokens: int | None = None          # caps the KV pool (tokens)
    mamba_ssm_dtype: str = "float32"
    kv_cache_dtype: str = "auto"                 # auto (the model dtype), bfloat16, fp8_e4m3
    max_running_requests: int | None = None
    page_size: int = 16
    context_length: int | None = None            # default: the model's max_position_embeddings
    max_prompt_tokens: int | None = None         # longer prompts are refused (default: the context length)
    chunked_prefill_size: int = 2048             # most prompt tokens of one request per step
    max_prefill_tokens: int = 8192               # most tokens (prefill and decode) in one step
    max_decode_stall_ms: float = 1000.0          # prompt tokens per step while others decode: a step about this long
    random_seed: int = 0                         # seeds requests that set no seed of their own
    attention_backend: str = "auto"              # MLA decode and the indexer: auto (Triton on CUDA), torch, triton
    moe_backend: str = "auto"                    # routed experts
    kda_backend: str = "auto"                    # KDA decode and prefill over the state pool
    norm_backend: str = "auto"                   # AttnRes mix + RMSNorm
    moe_mxfp8_activations: bool = False          # round routed-expert GEMM inputs to MXFP8 (W4A8, as K3's QAT)
    moe_dense_experts: str = "none"              # CPU: keep a dense copy of MXFP4 experts (none, bfloat16, float32)
    moe_onednn_experts: bool = False             # CPU: oneDNN-packed copies of float32 experts (+4 B per weight)
    disable_radix_cache: bool = False            # prefix caching off: every prompt computed from its first token
    mamba_scheduler_strategy: str = "no_buffer"  # prefix cache: where KDA state snapshots are taken (see radix.py)
    mamba_track_interval: int = 256              # extra_buffer: a snapshot every this many decode tokens
    enable_hierarchical_cache: bool = False      # evicted cache entries spill to host memory, then storage
    hicache_ratio: float = 2.0                   # host tier size as a multiple of the device caches
    hicache_size: int = 0                        # host tier size in GB (overrides hicache_ratio when > 0)
    hicache_storage_backend: str = "none"        # third tier: none, file
    hicache_storage_dir: str | None = None       # the file backend's directory
    tp_size: int = 1                             # tensor parallelism (ranks per model replica)
    ep_size: int = 1                             # expert parallelism over the TP ranks
    dp_size: int = 1                             # data parallelism (with enable_dp_attention: attention only)
    enable_dp_attention: bool = False
    moe_a2a_backend: str = "none"                # none (all-reduce) or torch (all-to-all dispatch and combine)
    enable_eplb: bool = False                    # rebalance the routed experts by their load
    ep_num_redundant_experts: int = 0            # extra expert slots (copies of hot experts)
    eplb_rebalance_num_iterations: int = 1000    # steps between rebalances
    dcp_size: int = 1                            # decode context parallelism of the MLA cache
    pp_size: int = 1                             # pipeline stages
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None            # HOST:PORT of rank 0's rendezvous (multi-node)
    speculative_algorithm: str = "none"          # none, NGRAM (earlier tokens), NEXTN (MTP), DFLASH (a block draft:
                                                 # kestrel's own, or a published DFlash or DSpark draft), DSPARK
                                                 # (SGLang's name for DFLASH with a DSpark draft),
                                                 # STANDALONE (a smaller model sharing the tokenizer)
    speculative_num_draft_tokens: int = 4        # draft tokens verified per step
    speculative_disable_by_batch_size: int | None = None  # draft only while at most this many sequences run
                                                 # (vLLM's flag; above it speculation costs more than it saves)
    speculative_draft_min_confidence: float = 0.0  # DFLASH (kestrel's block draft): the blocks stop before the
                                                 # draft at which the product of the draft's probabilities, averaged
                                                 # over the step's drafting sequences, falls below it
    speculative_draft_model_path: str | None = None  # DFLASH: the draft's folder (kestrel block draft or NeMo's or
                                                 # SpecForge's DFlash draft); STANDALONE: the draft model's
    speculative_token_map: str | None = None     # NEXTN, DFLASH: a file of token ids the drafts are chosen among
                                                 # (SGLang's FR-Spec flag; spec/token_map.py)
    disable_cuda_graph: bool = False             # decode eagerly even where CUDA graphs could replay it
    disable_cpu_kernels: bool = False            # CPU: torch's kernels only, not kestrel.ops.cpu's (process-wide)
    cuda_graph_max_bs: int = 128                 # largest decode batch replayed from a graph (bigger run eagerly)
    enable_torch_compile: bool = False           # CPU: decode steps (decode_graphs.py) and the KDA prefill's chunk
                                                 # terms (ops/torch/kda.py) compiled by torch.compile, a step waiting
                                                 # for its graph
    enable_background_compile: bool = False      # CPU: the same compiled in the background (background_compile.py)
    torch_compile_max_bs: int = 32               # largest decode batch run compiled (bigger run eagerly)
    enable_deterministic_inference: bool = False  # batch-invariant operators, token-by-token layers (deterministic.py)

    def __post_init__(self) -> None:
        if self.speculative_algorithm == "DSPARK":      # kestrel's DFLASH drafter runs DSpark drafts
            if not is_dspark_draft(self.speculative_draft_model_path):
                raise ValueError("--speculative-algorithm DSPARK drafts with a DSpark draft (NeMo's KimiK3DSparkModel "
                                 "or Qwen3DSparkModel): pass its folder as --speculative-draft-model-path.")
            self.speculative_algorithm = "DFLASH"
        checks = [
            (self.dtype in ("auto", *DTYPES), "dtype", f"one of auto, {', '.join(DTYPES)}"),
            (self.mem_fraction_static is None or 0 < self.mem_fraction_static <= 1, "mem_fraction_static",
             "in (0, 1]"),
            (self.mamba_full_memory_ratio > 0, "mamba_full_memory_ratio", "positive"),
            (self.max_mamba_cache_size is None or self.max_mamba_cache_size >= 1, "max_mamba_cache_size",
             "at least 1"),
            (self.max_total_tokens is None or self.max_total_tokens >= 1, "max_total_tokens", "at least 1"),
            (self.mamba_ssm_dtype in SSM_DTYPES, "mamba_ssm_dtype", f"one of {', '.join(SSM_DTYPES)}"),
            (self.moe_dense_experts in ("none", *DTYPES), "moe_dense_experts", f"one of none, {', '.join(DTYPES)}"),
            (self.kv_cache_dtype in ("auto", *KV_DTYPES), "kv_cache_dtype", f"one of auto, {', '.join(KV_DTYPES)}"),
            (self.max_running_requests is None or self.max_running_requests >= 1, "max_running_requests",
             "at least 1"),
            (self.page_size >= 1, "page_size", "at least 1"),
            (self.context_length is None or self.context_length >= 1, "context_length", "at least 1"),
            (self.max_prompt_tokens is None or self.max_prompt_tokens >= 1, "max_prompt_tokens", "at least 1"),
            (self.chunked_prefill_size >= 1, "chunked_prefill_size", "at least 1"),
            (self.max_prefill_tokens >= 1, "max_prefill_tokens", "at least 1"),
            (self.max_decode_stall_ms >= 0, "max_decode_stall_ms", "at least 0"),
            (self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs", "at least 1"),
            (self.torch_compile_max_bs >= 1, "torch_compile_max_bs", "at least 1"),
            (not (self.enable_torch_compile and self.enable_background_compile), "enable_background_compile",
             "left unset with --enable-torch-compile"),
            (self.mamba_scheduler_strategy in ("no_buffer", "extra_buffer"), "mamba_scheduler_strategy",
             "no_buffer or extra_buffer"),
            (self.mamba_track_interval >= 1, "mamba_track_interval", "at least 1"),
            (self.speculative_algorithm in ("none", "NGRAM", "NEXTN", "DFLASH", "STANDALONE"), "speculative_algorithm",
             "none, NGRAM, NEXTN, DFLASH, DSPARK or STANDALONE"),
            (self.speculative_algorithm not in ("DFLASH", "STANDALONE") or self.speculative_draft_model_path,
             "speculative_draft_model_path", "set for --speculative-algorithm DFLASH (the block draft's folder) and "
             "STANDALONE (the draft model's folder)"),
            (self.speculative_token_map is None or self.speculative_algorithm in ("NEXTN", "DFLASH"),
             "speculative_token_map", "set only with --speculative-algorithm NEXTN or DFLASH (the drafters that "
             "choose their tokens through an LM head)"),
            (self.speculative_num_draft_tokens >= 1, "speculative_num_draft_tokens", "at least 1"),
            (self.speculative_disable_by_batch_size is None or self.speculative_disable_by_batch_size >= 1,
             "speculative_disable_by_batch_size", "at least 1"),
            (0 <= self.speculative_draft_min_confidence < 1, "speculative_draft_min_confidence", "in [0, 1)"),
            (not self.speculative_draft_min_confidence or self.speculative_algorithm == "DFLASH",
             "speculative_draft_min_confidence", "set only with --speculative-algorithm DFLASH"),
            (self.hicache_ratio > 0, "hicache_ratio", "positive"),
            (self.hicache_size >= 0, "hicache_size", "at least 0"),
            (self.hicache_storage_backend in ("none", "file"), "hicache_storage_backend", "none or file"),
            (self.hicache_storage_backend != "file" or self.hicache_storage_dir, "hicache_storage_dir",
             "set for --hicache-storage-backend file"),
            (self.tp_size >= 1, "tp_size", "at least 1"),
            (self.ep_size >= 1, "ep_size", "at least 1"),
            (self.dp_size >= 1, "dp_size", "at least 1"),
            (self.dcp_size >= 1, "dcp_size", "at least 1"),
            (self.moe_a2a_backend in ("none", "torch"), "moe_a2a_backend", "none or torch"),
            (self.ep_num_redundant_experts >= 0, "ep_num_redundant_experts", "at least 0"),
            (self.eplb_rebalance_num_iterations >= 1, "eplb_rebalance_num_iterations", "at least 1"),
            (not self.enable_eplb or self.ep_size > 1, "enable_eplb", "set only with --ep-size above 1"),
            (not self.ep_num_redundant_experts or self.enable_eplb, "ep_num_redundant_experts",
             "set only with --enable-eplb (the rebalances fill them)"),
            (self.pp_size >= 1, "pp_size", "at least 1"),
            (self.nnodes >= 1, "nnodes", "at least 1"),
            (0 <= self.node_rank < self.nnodes, "node_rank", "in [0, nnodes)"),
        ]
        checks += [(getattr(self, f"{family}_backend") in CHOICES, f"{family}_backend",
                    f"one of {', '.join(CHOICES)}") for family in FAMILIES]
        for ok, name, allowed in checks:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}.")
        if (self.moe_a2a_backend != "none" or self.enable_eplb) and (self.enable_torch_compile
                                                                     or self.enable_background_compile):
            raise ValueError("the all-to-all MoE and EPLB run eagerly (their token counts change every step); drop "
                             "--enable-torch-compile / --enable-background-compile or them.")
        if (self.speculative_algorithm == "DFLASH" and (self.pp_size > 1 or self.dcp_size > 1
                                                        or self.enable_dp_attention)
                and is_dflash_draft(self.speculative_draft_model_path)):
            raise ValueError("a DFlash draft reads target layers across the whole model and writes its context "
                             "latents beside every token's, so it runs without pipeline stages, decode context "
                             "parallelism and DP attention (--pp-size 1, --dcp-size 1, no --enable-dp-attention).")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add `--model` and every engine flag (SGLang spellings) to parser."""
        for f in fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            kind = {"int | None": int, "float | None": float, "int": int, "float": float}.get(str(f.type), str)
            if f.type == "bool":
                parser.add_argument(flag, action="store_true", help=HELP[f.name])
            elif f.name == "model":
                parser.add_argument(flag, default=str(BUNDLED_MODEL), help=HELP[f.name])
            else:
                parser.add_argument(flag, type=kind, default=f.default, help=HELP[f.name])

    def torch_compile(self, device: torch.device) -> str | None:
        """How steps on device are compiled: "foreground" (--enable-torch-compile), "background"
        (--enable-background-compile) or None (eagerly: the default, and anywhere but on a CPU)."""
        if device.type != "cpu":
            return None
        if self.enable_torch_compile:
            return "foreground"
        return "background" if self.enable_background_compile else None

    def dp_group_args(self) -> EngineArgs:
        """The arguments one DP attention group's pools are planned from: --max-running-requests and
        --max-mamba-cache-size count every group's (as SGLang's do), so each group plans for its share."""
        dp = self.dp_size if self.enable_dp_attention else 1
        if dp == 1:
            return self
        share = {name: max(1, getattr(self, name) // dp) for name in ("max_running_requests", "max_mamba_cache_size")
                 if getattr(self, name) is not None}
        return dataclasses.replace(self, **share)

    def model_dtype(self, device: torch.device) -> torch.dtype | None:
        """The dtype the model is loaded in (None: the checkpoint's). auto is float32 on the CPU: kestrel's CPU
        kernels and torch's CPU products compute in float32, and a bfloat16 step widens operands in every product
        (the bundled model's eager decode step: 6.9 ms in float32 against 12.8 in bfloat16, one thread)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.float32 if device.type == "cpu" else None

    def apply_backends(self) -> None:
        """Make every op family run the implementation chosen here, and kestrel's CPU kernels run or not (a
        process-wide setting)."""
        for family in FAMILIES:
            set_backend(getattr(self, f"{family}_backend"), family)
        cpu.set_enabled(not self.disable_cpu_kernels)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
