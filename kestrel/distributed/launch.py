"""Starting an instance's ranks and their process groups: spawned on this machine by rank 0 (and by each other
node's first rank with --nnodes), or launched one process per rank by torchrun.

Rank r of W runs on node r // (W / nnodes). Process groups: the tensor-parallel collectives run on each pipeline
stage's TP group, the stages' sends on the default group (NCCL on CUDA, gloo on the CPU, `timeout_s` per
collective: a rank that stops answering fails the step);
the step messages rank 0 sends go through a gloo group without a practical timeout, so idle ranks wait for work.
A rank whose peer dies gets an error at once (gloo and NCCL see the closed connection), so nothing hangs.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .layout import ParallelLayout
from .parallel import Parallel

log = logging.getLogger("kestrel")

COLLECTIVE_TIMEOUT_S = 600
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class RankSpec:
    """Where one rank runs: its rank, its device index on its node, and the rendezvous address."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str          # tcp://HOST:PORT, or env:// under torchrun
    spawned: bool             # started by another kestrel process (dies with it)
    node_ranks: int | None = None     # ranks on this rank's node (None: all of them)


def torchrun_spec() -> RankSpec | None:
    """This process's rank when torchrun (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR) started it."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world = int(env["WORLD_SIZE"])
    return RankSpec(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), "env://", False,
                    int(env.get("LOCAL_WORLD_SIZE", world)))


def node_specs(layout: ParallelLayout, nnodes: int, node_rank: int, dist_init_addr: str | None) -> list[RankSpec]:
    """The ranks this node runs (its first one is this process) when kestrel spawns them itself."""
    world = layout.world_size
    per_node = world // nnodes
    addr = dist_init_addr or f"127.0.0.1:{_free_port()}"
    first = node_rank * per_node
    return [RankSpec(first + i, world, i, f"tcp://{addr}", i > 0, per_node) for i in range(per_node)]


def this_process_spec(layout: ParallelLayout, args) -> tuple[RankSpec, list[RankSpec]]:
    """(this process's rank, the ranks it must spawn), from torchrun's environment or the node flags of args."""
    spec = torchrun_spec()
    if spec is not None and layout.world_size > 1:
        if spec.world_size != layout.world_size:
            raise ValueError(f"torchrun started {spec.world_size} processes but the layout needs "
                             f"{layout.world_size} (--tp-size); start one process per rank.")
        return spec, []
    specs = node_specs(layout, args.nnodes, args.node_rank, args.dist_init_addr)
    return specs[0], specs[1:]


def ranks_on_node(world_size: int, nnodes: int) -> int:
    """How many ranks share this machine (torchrun's LOCAL_WORLD_SIZE when it set one)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size // nnodes))


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of a rank: the CPU, or the CUDA device of its local rank (ranks beyond the node's GPU count share
    them, round robin: a correctness setup, e.g. TP2 on one GPU)."""
    base = torch.device(device)
    return base if base.type == "cpu" else torch.device(base.type, local_rank % max(torch.cuda.device_count(), 1))


def init_process_groups(spec: RankSpec, layout: ParallelLayout, device: torch.device,
                        timeout_s: float = COLLECTIVE_TIMEOUT_S) -> tuple[Parallel, dist.ProcessGroup]:
    """Join the instance: (the layers' Parallel over this rank's TP group, the gloo group for step messages).
    Ranks that share a GPU (NCCL refuses two ranks on one device) run their collectives through gloo, via host
    memory."""
    shared_gpu = device.type == "cuda" and torch.cuda.device_count() < (spec.node_ranks or spec.world_size)
    backend = "nccl" if device.type == "cuda" and not shared_gpu else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=spec.init_method, world_size=spec.world_size, rank=spec.rank,
                            timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Parallel(layout, tp_group(layout), via_host=shared_gpu, dcp_groups=dcp_groups(layout),
                    dp_groups=dp_groups(layout)), control


def dp_groups(layout: ParallelLayout) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Under DP attention (one pipeline stage): this rank's DP group (attn_tp_size consecutive ranks; None for one)
    and the ranks with its place in every DP group (every rank calls this together)."""
    if layout.dp_size == 1:
        return None, None
    if layout.pp_size > 1:
        raise ValueError("DP attention runs in one pipeline stage.")
    size = layout.attn_tp_size
    if size == 1:
        return None, dist.group.WORLD
    groups = [dist.new_group([g * size + i for i in range(size)]) for g in range(layout.dp_size)]
    across = [dist.new_group([g * size + i for g in range(layout.dp_size)]) for i in range(size)]
    return groups[layout.dp_rank], across[layout.attn_tp_rank]


def dcp_groups(layout: ParallelLayout) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's DCP group (dcp_size consecutive ranks of its TP group) and the ranks of its TP group that hold
    the same positions (one per DCP group); None for a single rank (every rank calls this together)."""
    tp, dcp = layout.tp_size, layout.dcp_size
    if dcp == 1:
        return None, None
    if dcp == tp and layout.pp_size == 1:
        return dist.group.WORLD, None
    base, group, cross = layout.pp_rank * tp, None, None
    for stage in range(layout.pp_size):
        first = stage * tp
        for g in range(tp // dcp):
            made = dist.new_group([first + g * dcp + i for i in range(dcp)])
            if first == base and g == layout.tp_rank // dcp:
                group = made
        if tp > dcp:
            for d in range(dcp):
                made = dist.new_group([first + g * dcp + d for g in range(tp // dcp)])
                if first == base and d == layout.dcp_rank:
                    cross = made
    return group, cross


def tp_group(layout: ParallelLayout) -> dist.ProcessGroup | None:
    """The TP group of this rank's pipeline stage: None for one rank, the default group for one stage (every rank
    calls this together: each stage's group is created on all ranks)."""
    if layout.tp_size == 1:
        return None
    if layout.pp_size == 1:
        return dist.group.WORLD
    groups = [dist.new_group([layout.with_rank(0).stage_rank(s) + r for r in range(layout.tp_size)])
              for s in range(layout.pp_size)]
    return groups[layout.pp_rank]


class Workers:
    """The rank processes this process spawned: started together, watched, and stopped together."""

    def __init__(self, target, specs: list[RankSpec], *args):
        context = mp.get_context("spawn")
        self.specs = specs
        self.processes = [context.Process(target=_worker_entry, args=(target, spec, *args), daemon=True,
                                          name=f"kestrel-rank-{spec.rank}") for spec in specs]
        for process in self.processes:
            process.start()

    def failures(self) -> list[str]:
        """'rank R exited with code C' for every rank process that is gone."""
        return [f"rank {spec.rank} exited with code {p.exitcode}" for spec, p in zip(self.specs, self.processes)
                if p.exitcode is not None]

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.processes]

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to timeout seconds for the ranks to exit, then SIGTERM and finally SIGKILL what is left."""
        for p in self.processes:
            p.join(timeout)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()


def _worker_entry(target, spec: RankSpec, *args) -> None:
    """A spawned rank: dies with the process that spawned it, then runs target(spec, *args)."""
    _die_with_parent()
    target(spec, *args)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits, however the parent ends (no orphan ranks)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
    except OSError:     # not Linux: the parent's daemon-process cleanup still stops the ranks on a normal exit
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
