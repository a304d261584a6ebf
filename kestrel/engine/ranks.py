"""The ranks of one engine instance: each rank's model shard, memory plan (agreed by all ranks) and caches, rank 0's
handle on the others, and the loop every other rank runs.

Rank 0 owns the scheduler, tokenizer and server; the others only execute the steps rank 0 sends (model_runner.Step)
on their shards. Every rank plans its pools from its own shard's bytes and its own device's memory; the ranks then
take the smallest slot and page counts, so the pools are the same size everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..config import ModelConfig
from ..distributed.channel import StepChannel, agree_min
from ..distributed.launch import (RankSpec, Workers, init_process_groups, rank_device, ranks_on_node,
                                  this_process_spec, torchrun_spec)
from ..distributed.layout import ParallelLayout
from ..distributed.parallel import Parallel
from ..distributed.pipeline import StageLink
from ..layers import linear as linear_layers
from ..layers.cache import HybridCache
from ..layers.linear import fuse_linear_groups, hold_column_major, pack_onednn_weights
from ..layers.moe import EXPERT_PACKED_MIN_WEIGHT, RoutedExperts, hold_dense_experts, pack_onednn_experts
from ..models.block_draft import BlockDraftModel, load_block_draft
from ..models.checkpoint import load_model
from ..models.dflash_draft import ContextWriter, DFlashDraftModel, is_dflash_draft, load_dflash_draft
from ..models.kimi import KimiForCausalLM
from ..ops import batch_invariant
from . import deterministic
from .args import DTYPES, KV_DTYPES, MODEL_DRAFTERS, SSM_DTYPES, EngineArgs
from .cache.device_ops import DeviceOps
from .cache.page_table import PageTable
from .cache.planner import MemoryPlan, MemoryPlanError, device_memory, plan_memory
from .expert_balance import ExpertBalancer
from .handoff import HandoffLayout
from .model_runner import Draft, ModelRunner, Save
from .speculative.block import BlockDrafter
from .speculative.dflash import DFlashDrafter
from .speculative.mtp import MTPDrafter
from .speculative.staged import StagedDrafter
from .speculative.token_map import HotHead, load_token_map

log = logging.getLogger("kestrel")

DEATH_NOTICE_S = 2.0
"""After a collective fails, how long rank 0 waits for a dead rank's exit code, to name it in the error."""


@dataclass
class RankShard:
    """One rank's model shard, its pools' plan (the same on every rank), its caches and page table."""

    model: KimiForCausalLM
    plan: MemoryPlan
    cache: HybridCache
    page_table: PageTable
    graphs: bool               # decode by CUDA graphs (one rank only); the pools then hold one scratch slot and page
    draft: BlockDraftModel | DFlashDraftModel | KimiForCausalLM | None = None   # DFLASH's draft or STANDALONE's,
    draft_cache: HybridCache | None = None                    # its weights (and caches) counted in the plan
    handoff_layout: HandoffLayout | None = None   # one process's caches, as PD handoffs hold them
    hot_head: HotHead | None = None   # a model drafter's LM head cut to --speculative-token-map (in the plan)
    balancer: ExpertBalancer | None = None    # with expert parallelism: the expert load, and EPLB


def _lay_out_linears(model: nn.Module, compiled: bool, pack: bool = True) -> int:
    """Lay out model's linear weights for inference: column-major where MKL multiplies them faster (not when its
    decode steps are compiled, whose single rows multiply as reductions that read weights faster row-major:
    linear.compiled_matvec), fused by LinearGroup, packed for oneDNN where pack (deterministic inference multiplies
    on its own kernels); returns the bytes the packed copies add."""
    if not compiled:
        hold_column_major(model)
    fuse_linear_groups(model, column_major_ok=not compiled)
    return pack_onednn_weights(model) if pack else 0


def load_shard(args: EngineArgs, par: Parallel, device: torch.device, control: dist.ProcessGroup | None = None,
               graphs: bool = False) -> RankShard:
    """Load this rank's model shard, plan its pools and allocate them (all ranks call this together). With graphs
    (decode by CUDA graphs), the pools get one scratch slot and page beyond the plan."""
    args.apply_backends()
    layout = par.layout
    model = load_model(Path(args.model), args.model_dtype(device), device, par,
                       embed_last_stage=args.speculative_algorithm in MODEL_DRAFTERS)
    config = model.config
    if args.enable_deterministic_inference:
        deterministic.prepare(model)
    if args.moe_mxfp8_activations:
        _use_mxfp8_activations(model, args.model)
    dense_experts = _hold_dense_experts(model, args, device)
    compiled = graphs and device.type == "cpu"
    pack = not args.enable_deterministic_inference
    packed = _lay_out_linears(model, compiled, pack) + _pack_onednn_experts(model, args, device)
    dtype = model.dtype
    ssm_dtype = SSM_DTYPES[args.mamba_ssm_dtype]
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else KV_DTYPES[args.kv_cache_dtype]
    weights = _bytes_by_address(model.state_dict().values())
    draft = None
    if args.speculative_algorithm == "DFLASH" and is_dflash_draft(args.speculative_draft_model_path):
        draft = load_dflash_draft(args.speculative_draft_model_path, config, dtype, device)
    elif args.speculative_algorithm == "DFLASH" and layout.last_stage:     # it drafts where the hidden states are
        draft = load_block_draft(args.speculative_draft_model_path, dtype, device)
    elif args.speculative_algorithm == "STANDALONE" and layout.rank == 0:    # it drafts in rank 0's process
        draft = _load_draft_model(args.speculative_draft_model_path, config, dtype, device)
    if draft is not None:
        packed += _lay_out_linears(draft, compiled, pack)
        weights |= _bytes_by_address(draft.state_dict().values())
    hot_head = _hot_head(args, model, draft) if layout.last_stage else None
    if hot_head is not None:
        weights |= _bytes_by_address(hot_head.buffers())
    draft_config = draft.config if isinstance(draft, KimiForCausalLM) else None
    cache_config = layout.cache_config(config)
    # the MTP drafter's layer (on the last stage) caches latents too
    mtp_layers = 1 if args.speculative_algorithm == "NEXTN" and layout.last_stage else 0
    dflash = isinstance(draft, DFlashDraftModel)         # its context rows are paged beside the latents
    draft_layers, draft_width = (draft.num_layers, draft.context_width) if dflash else (0, 0)

    memory = device_memory(device)
    if device.type == "cpu":        # the ranks on one machine share its memory
        memory //= ranks_on_node(layout.world_size, args.nnodes)

    def plan(engine_args: EngineArgs) -> MemoryPlan:
        return plan_memory(cache_config, engine_args, sum(weights.values()) + dense_experts + packed, memory, dtype,
                           ssm_dtype, kv_dtype, mtp_layers, draft_config, draft_layers, draft_width)

    args = args.dp_group_args()
    memory_plan = plan(args)
    prefix = f"rank {layout.rank}: " if control is not None else ""
    log.info("%s%s", prefix, memory_plan.describe())
    if control is not None:
        slots, pages = agree_min([memory_plan.num_slots, memory_plan.num_pages], control)
        memory_plan = plan(dataclasses.replace(args, max_mamba_cache_size=slots,
                                               max_total_tokens=pages * args.page_size))
        log.info("%spools agreed by all %d ranks (each takes the smallest): %d state slots, %d KV pages", prefix,
                 layout.world_size, slots, pages)
    scratch = 1 if graphs else 0      # a state slot and a page, beyond the pools, for graph batches' padding
    slots, pages = memory_plan.num_slots, memory_plan.num_pages
    try:
        cache = HybridCache.allocate(cache_config, slots + scratch, pages + scratch, memory_plan.page_size,
                                     dtype, ssm_dtype, kv_dtype, device, mtp_layers, layout.dcp_size, draft_layers,
                                     draft_width)
        draft_cache = None if draft_config is None else HybridCache.allocate(
            draft_config, slots + scratch, pages + scratch, memory_plan.page_size, dtype, ssm_dtype, kv_dtype, device)
    except RuntimeError as e:      # torch.OutOfMemoryError on CUDA, a RuntimeError from the CPU allocator
        size = (memory_plan.state_pool_bytes + memory_plan.kv_pool_bytes) / 2**30
        raise MemoryPlanError(f"allocating the caches ({size:.2f} GiB) ran out of memory; lower "
                              "--mem-fraction-static, --max-total-tokens or --max-mamba-cache-size.") from e
    if dflash:                                       # the target's forward writes the draft's context rows
        model.model.draft_context = ContextWriter(draft, cache)
    max_pages = -(-memory_plan.context_length // memory_plan.page_size)
    # every row starts as the scratch page (page 0 without graphs); the scratch slot's row stays so
    page_table = PageTable(slots + scratch, max_pages, fill=pages if graphs else 0, device=device)
    context = "mtp" if args.speculative_algorithm == "NEXTN" else "dflash" if dflash else None
    handoff_layout = HandoffLayout(HybridCache.allocate(
        config, 1, 1, memory_plan.page_size, dtype, ssm_dtype, kv_dtype, "meta", int(context == "mtp"), 1,
        draft_layers, draft_width), len(config.mla_layers), context)
    balancer = ExpertBalancer(model, par, args.eplb_rebalance_num_iterations, args.enable_eplb) \
        if layout.ep_size > 1 else None
    return RankShard(model, memory_plan, cache, page_table, graphs, draft, draft_cache, handoff_layout, hot_head,
                     balancer)


def _bytes_by_address(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Each tensor's bytes by its data address (so that tensors sharing one, tied weights, count once)."""
    return {t.data_ptr(): t.numel() * t.element_size() for t in tensors}


def _hot_head(args: EngineArgs, model: KimiForCausalLM, draft: nn.Module | None) -> HotHead | None:
    """The drafter's LM head (the MTP layer's for NEXTN, the target's for DFLASH) cut to --speculative-token-map's
    tokens; None without one."""
    if args.speculative_token_map is None:
        return None
    if isinstance(draft, DFlashDraftModel) and draft.lm_head is not None:
        raise ValueError("--speculative-token-map cuts the target's LM head, and this DSpark draft drafts through "
                         "its own lm_head and Markov head; serve it without a token map.")
    if args.speculative_algorithm == "DFLASH":
        head = model.lm_head
    elif model.mtp_layers:
        head = model.mtp_layers[0].shared_head.head
    else:
        return None                   # model_drafter refuses NEXTN without MTP layers
    ids = load_token_map(args.speculative_token_map, model.config.vocab_size)
    return HotHead(head.weight, ids, model.config.vocab_size, model.par.attn)


def model_drafter(args: EngineArgs, shard: RankShard, compile: str | None = None
                  ) -> MTPDrafter | BlockDrafter | DFlashDrafter | StagedDrafter | None:
    """The drafter that reads the target's hidden states, on this rank's shard: NEXTN's MTP layers, DFLASH's
    block draft (compiled by the torch.compile backend `compile`, if any), which under pipeline stages draft on the
    last stage (spec.staged), or DFLASH's published DFlash draft (eager, one stage); None for the other algorithms."""
    if args.speculative_algorithm not in MODEL_DRAFTERS:
        return None
    model, layout = shard.model, shard.model.par.layout
    if args.speculative_algorithm == "NEXTN" and not model.config.num_nextn_predict_layers:
        raise ValueError(f"--speculative-algorithm NEXTN drafts with the model's MTP layers, and {args.model} "
                         "has none.")
    local = None
    if layout.last_stage and args.speculative_algorithm == "NEXTN":
        local = MTPDrafter(model, shard.cache, shard.page_table, shard.hot_head)
    elif isinstance(shard.draft, DFlashDraftModel):
        if args.speculative_draft_min_confidence:
            raise ValueError("--speculative-draft-min-confidence cuts kestrel's block drafts; a published DFlash or "
                             "DSpark draft verifies its whole block.")
        local = DFlashDrafter(model, shard.page_table, args.speculative_num_draft_tokens, shard.hot_head)
    elif layout.last_stage:
        local = BlockDrafter(model, shard.draft, args.speculative_num_draft_tokens, compile, shard.hot_head,
                             args.speculative_draft_min_confidence)
    if layout.pp_size == 1:
        return local
    return StagedDrafter(local, StageLink(layout, model.par.via_host), model.device)


def _load_draft_model(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device) -> KimiForCausalLM:
    """STANDALONE's draft model (in the target's dtype); a ValueError unless it shares the target's vocabulary."""
    draft = load_model(Path(path), dtype, device)
    if draft.config.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {path} has a vocabulary of {draft.config.vocab_size} tokens and the "
                         f"target {target.vocab_size}; a STANDALONE draft must share the target's tokenizer.")
    return draft


def _use_mxfp8_activations(model: KimiForCausalLM, name: str) -> None:
    """Round every routed expert's GEMM inputs to MXFP8 (blocks of 32 along both GEMMs' input widths)."""
    config = model.config
    widths = (config.expert_dim, config.moe_intermediate_size)
    if not config.num_experts:
        raise ValueError(f"--moe-mxfp8-activations needs routed experts, and {name} has none.")
    if any(w % 32 for w in widths):
        raise ValueError(f"--moe-mxfp8-activations needs expert widths that are multiples of 32, and "
                         f"{name}'s are {widths}.")
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.mxfp8_activations = True


def _hold_dense_experts(model: KimiForCausalLM, args: EngineArgs, device: torch.device) -> int:
    """--moe-dense-experts: a dense copy of the MXFP4 routed experts for the CPU's in-place MoE (about 2x faster
    experts for 2 or 4 bytes per weight, docs/benchmarks.md moe-cpu); returns the bytes the copy takes."""
    if args.moe_dense_experts == "none":
        return 0
    mxfp4 = model.config.experts_mxfp4
    if device.type != "cpu" or not mxfp4:
        raise ValueError(f"--moe-dense-experts is for MXFP4 experts on the CPU, and {args.model} on "
                         f"{device.type} has {'MXFP4' if mxfp4 else 'dense'} experts.")
    return hold_dense_experts(model, DTYPES[args.moe_dense_experts])


def _pack_onednn_experts(model: KimiForCausalLM, args: EngineArgs, device: torch.device) -> int:
    """--moe-onednn-experts: oneDNN-packed copies of the dense float32 routed experts, which multiply their rows
    1.6-2.9x faster on an AMD EPYC (kestrel.ops.torch.moe; a 437M K3's prefill of 128 tokens 1.2-1.4x) for
    4 bytes per weight, and slower on Intel's CPUs (kestrel.layers.moe.EXPERT_PACKED_MIN_WEIGHT), which refuse the
    flag; returns the bytes the copies take."""
    if not args.moe_onednn_experts:
        return 0
    if device.type == "cpu" and not linear_layers.ONEDNN:
        raise ValueError("--moe-onednn-experts is for CPUs on which oneDNN multiplies faster than MKL (any but "
                         "Intel's); on this Intel CPU the routed experts' own products are the faster.")
    added = pack_onednn_experts(model)
    if not added:
        raise ValueError(f"--moe-onednn-experts packs float32 routed experts of at least {EXPERT_PACKED_MIN_WEIGHT:,} "
                         f"weights per expert's w2 on the CPU (MXFP4 ones with --moe-dense-experts float32), and "
                         f"{args.model} on {device.type} has none.")
    return added


class Ranks:
    """Rank 0's side of a distributed instance: the layers' Parallel, the step channel, the ranks it spawned."""

    def __init__(self, args: EngineArgs, layout: ParallelLayout):
        spec, others = this_process_spec(layout, args)
        if spec.rank != 0:
            raise ValueError(f"this process is rank {spec.rank}; only rank 0 runs the engine (start the other "
                             "ranks with `kestrel serve`, which runs them as workers).")
        self.workers = Workers(run_rank, others, args) if others else None
        self.stopped = False
        self.device = rank_device(args.device, spec.local_rank)
        try:
            self.par, self.control = init_process_groups(spec, layout, self.device)
        except BaseException:
            self.stop()
            raise
        self.channel = StepChannel(self.control)

    def send(self, message) -> None:
        """Hand a model_runner.Step or Save to every other rank."""
        self.channel.send(message)

    def gather(self, entry) -> list:
        """Every rank's answer to a Save (this one's first)."""
        return self.channel.gather(entry)

    def dead(self) -> str | None:
        """Which ranks this process spawned have exited, if any, while the instance was meant to run."""
        if self.workers is None or self.stopped:
            return None
        return "; ".join(self.workers.failures()) or None

    def explain(self, error: BaseException) -> str:
        """What failed: the ranks that died (waiting briefly for their exit), else the error itself."""
        if self.workers is not None:
            wait(self.workers.sentinels, DEATH_NOTICE_S)
            dead = self.workers.failures()
            if dead:
                return "; ".join(dead) + " (its log says why)"
        return f"{type(error).__name__}: {error}"

    def stop(self, failed: bool = False) -> None:
        """Tell the other ranks to exit (if they still listen) and wait for the ones this process spawned. failed:
        a step failed, so the others may sit in a collective this rank left: the spawned ones are stopped at once,
        unasked (ranks launched elsewhere see this one's connections close)."""
        if self.stopped:
            return
        self.stopped = True
        if failed and self.workers is not None:
            self.workers.stop(timeout=0)
        if dist.is_initialized():
            try:
                if not failed and (self.workers is None or not self.workers.failures()):
                    self.channel.send(None)
            except Exception:      # a rank is gone: the others see its connection close and exit on their own
                pass
            dist.destroy_process_group()
        if self.workers is not None:
            self.workers.stop()


def run_rank(spec: RankSpec, args: EngineArgs) -> None:
    """A rank other than 0: join the instance, load its shard, then execute rank 0's steps until told to stop.
    Any failure is logged and ends the process with code 1 (rank 0 then sees its connection close)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format=f"[rank {spec.rank}] %(message)s")
    try:
        layout = ParallelLayout.from_args(args, spec.rank)
        device = rank_device(args.device, spec.local_rank)
        if device.type == "cpu" and spec.spawned:      # a fair share of the cores (rank 0 keeps its setting)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_node(spec.world_size, args.nnodes)))
        par, control = init_process_groups(spec, layout, device)
        shard = load_shard(args, par, device, control)
        runner = ModelRunner(shard.model, shard.cache, shard.page_table, DeviceOps(),
                             drafter=model_drafter(args, shard), balancer=shard.balancer)
        channel = StepChannel(control)
        with batch_invariant.invariant() if args.enable_deterministic_inference else contextlib.nullcontext():
            while (message := channel.receive()) is not None:
                if isinstance(message, Save):
                    channel.gather(runner.read(message))
                elif isinstance(message, Draft):
                    runner.run_draft(message)
                else:
                    runner.execute(message)
        dist.destroy_process_group()
    except BaseException:
        log.exception("rank %d failed", spec.rank)
        logging.shutdown()
        os._exit(1)


def run_node(args: EngineArgs) -> int:
    """A node's ranks when rank 0 is elsewhere (torchrun's other ranks, or --node-rank > 0): spawn this node's
    other ranks, run the first one here until rank 0 stops the instance; the exit code (0, or 1 on failure)."""
    layout = ParallelLayout.from_args(args)
    spec, others = this_process_spec(layout, args)
    workers = Workers(run_rank, others, args) if others else None
    try:
        run_rank(spec, args)
    finally:
        if workers is not None:
            workers.stop()
    return 1 if workers is not None and any(p.exitcode for p in workers.processes) else 0


def is_rank_zero(args: EngineArgs) -> bool:
    """Whether this process is rank 0 of its instance (runs the engine) rather than a worker rank."""
    spec = torchrun_spec()
    if spec is not None and ParallelLayout.from_args(args).world_size > 1:
        return spec.rank == 0
    return args.node_rank == 0
