"""The distributed tests' scripted run: four sequences through five steps of a ModelRunner, as the engine would
send them (chunked prefill of a 30-token prompt, a 6-token and a 1-token prompt, then decode; a fork that copies a
state slot and a partial page through the DeviceOps journal and shares a full page), on any rank's model shard.

Every step asks for logits at every position; the oracle is one plain forward (no cache) of each whole sequence.
"""

from __future__ import annotations

import torch

from kestrel.distributed.layout import ParallelLayout, partition
from kestrel.distributed.traffic import Forward
from kestrel.engine.cache.page_table import PageTable
from kestrel.engine.cache.shards import gather_entry
from kestrel.engine.expert_balance import ExpertBalancer
from kestrel.engine.handoff import handoff_parts
from kestrel.engine.model_runner import ModelRunner, Save, Step
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.models.kimi import KimiForCausalLM

PAGE, ROW = 4, 8                       # tokens per page; pages per page-table row (slot s owns pages 8s..8s+7)
_gen = torch.Generator().manual_seed(0)
A, B, C = (torch.randint(3, 250, (n,), generator=_gen).tolist() for n in (32, 10, 4))
FORK_AT = 6
D = B[:FORK_AT] + torch.randint(3, 250, (4,), generator=_gen).tolist()   # forks from B after B's 6-token prompt
SEQUENCES = {"A": A, "B": B, "C": C, "D": D}
GROUPS = {"A": 0, "B": 1, "C": 0, "D": 1}   # under DP attention: each sequence's DP group (D forks B)
# per step: (name, start, length) of each chunk
CHUNKS = [[("A", 0, 11), ("B", 0, 6)],
          [("A", 11, 14), ("B", 6, 1), ("C", 0, 1), ("D", 6, 1)],
          [("A", 25, 5), ("B", 7, 1), ("C", 1, 1), ("D", 7, 1)],
          [("A", 30, 1), ("B", 8, 1), ("C", 2, 1), ("D", 8, 1)],
          [("A", 31, 1), ("B", 9, 1), ("C", 3, 1), ("D", 9, 1)]]


def group_of(name: str, dp: int) -> int:
    return GROUPS[name] if dp > 1 else 0


def slots(dp: int = 1) -> dict[str, int]:
    """Each sequence's state slot in its DP group's pools (in name order within a group)."""
    names = sorted(SEQUENCES)
    return {name: [n for n in names if group_of(n, dp) == group_of(name, dp)].index(name) for name in names}


SLOTS = slots()


def step_chunks(dp: int = 1) -> list[list[tuple[str, int, int]]]:
    """CHUNKS with each step's chunks group by group (as DPScheduler hands them out)."""
    return [sorted(chunks, key=lambda c: group_of(c[0], dp)) for chunks in CHUNKS]


def _row(slot: int, pages: list[int]) -> list[int]:
    return [x for column, page in enumerate(pages) for x in (slot, column, page)]


def steps(dp: int = 1) -> list[Step]:
    slot = slots(dp)
    own = {name: [ROW * s + i for i in range(ROW)] for name, s in slot.items()}
    group = {name: group_of(name, dp) for name in SEQUENCES}
    out = []
    for i, chunks in enumerate(step_chunks(dp), 1):
        table, ops = [[] for _ in range(dp)], [[] for _ in range(dp)]      # per DP group
        if i == 1:
            for name in ("A", "B", "C"):
                table[group[name]] += _row(slot[name], own[name])
        if i == 2:      # D shares B's full first page and gets a copy of B's half-full second page
            table[group["D"]] += _row(slot["D"], [own["B"][0], own["D"][1]] + own["D"][2:])
            ops[group["D"]] += [("slots", [slot["B"]], [slot["D"]]), ("pages", [own["B"][1]], [own["D"][1]])]
        width = max(-(-(start + length) // PAGE) for _, start, length in chunks)
        counts = tuple(sum(group[c[0]] == g for c in chunks) for g in range(dp)) if dp > 1 else ()
        ids = [t for name, start, length in chunks for t in SEQUENCES[name][start:start + length]]
        out.append(Step(ops, table, ids, [c[1] for c in chunks], [c[2] for c in chunks],
                        [slot[c[0]] for c in chunks], width, list(range(len(chunks))), [], groups=counts))
    return out


def forwards(dp: int = 1) -> list[list[Forward]]:
    """The shape of each scripted step's share of each DP group (every position's logits), for the traffic
    formulas."""
    def shape(chunks):
        return Forward(sum(c[2] for c in chunks), len(chunks), max((c[2] for c in chunks), default=0),
                       max((c[1] + c[2] for c in chunks), default=0), sum(c[2] for c in chunks))
    return [[shape([c for c in chunks if group_of(c[0], dp) == g]) for g in range(dp)] for chunks in CHUNKS]


TIE_GAP = 5e-5
"""The least gap between a token's k-th and (k+1)-th routing scores for which a rank's choice is that of one
process: the ranks' scores differ by float32 reordering upstream (the logits by at most 2e-5, test_tp_logits), and
the sigmoid's slope is at most 1/4; the test models' least gap is 1.3e-4."""


@torch.inference_mode()
def routing(model: KimiForCausalLM) -> dict[str, list[torch.Tensor]]:
    """Each sequence's chosen experts at every position, per MoE layer [len, k], from one plain forward of the
    single-process model; asserts that no choice is within TIE_GAP of a tie (so a rank's float32 rounding chooses
    the same experts)."""
    gates = [layer.block_sparse_moe.gate for layer in model.model.decoder_layers if hasattr(layer, "block_sparse_moe")]
    seen: list[torch.Tensor] = []

    def record(gate, args, out):
        choice = torch.sigmoid(args[0].float() @ gate.weight.float().t()) + gate.e_score_correction_bias
        best = choice.topk(gate.top_k + 1, dim=-1).values
        assert (best[:, -2] - best[:, -1]).min() > TIE_GAP, "a near tie in the routing: choose other test weights"
        seen.append(out[0])

    hooks = [gate.register_forward_hook(record) for gate in gates]
    try:
        out = {}
        for name, ids in SEQUENCES.items():
            seen.clear()
            model(torch.tensor(ids), ForwardBatch.build([len(ids)]))
            out[name] = list(seen)
    finally:
        for hook in hooks:
            hook.remove()
    return out


def a2a_pairs(model: KimiForCausalLM, layout: ParallelLayout) -> list[tuple[int, int]]:
    """Per scripted step, the (token, rank) pairs layout.rank dispatches to other ranks and the rows it returns to
    them over every MoE layer, as kestrel.layers.expert_dispatch routes them (no redundant experts)."""
    chosen = routing(model)
    dp, attn_tp, moe_tp = layout.dp_size, layout.attn_tp_size, layout.moe_tp_size
    per_group = model.config.num_experts // layout.ep_size
    out = []
    for chunks in step_chunks(dp):
        sent = returned = 0
        for layer in range(len(next(iter(chosen.values())))):
            for g in range(dp):
                tokens = [chosen[name][layer][i] for name, start, length in chunks if group_of(name, dp) == g
                          for i in range(start, start + length)]
                for a in range(attn_tp):
                    lo, hi = partition(len(tokens), attn_tp, a)
                    owner = g * attn_tp + a
                    for ids in tokens[lo:hi]:
                        ranks = {e // per_group * moe_tp + m for e in ids.tolist() for m in range(moe_tp)}
                        sent += owner == layout.tp_rank and len(ranks - {owner})
                        returned += owner != layout.tp_rank and layout.tp_rank in ranks
        out.append((sent, returned))
    return out


def handoff_parts_of_a() -> list:
    """Sequence A's state slot and pages (a PD handoff's parts) after the script."""
    return handoff_parts(SLOTS["A"], [ROW * SLOTS["A"] + i for i in range(-(-len(A) // PAGE))])


def run_script(model: KimiForCausalLM, layout: ParallelLayout, balancer: ExpertBalancer | None = None
               ) -> tuple[dict[str, torch.Tensor], ModelRunner]:
    """Each sequence's logits [len, vocab] at every position, from the scripted steps on this rank's shard (and,
    with a balancer, each of its windows' load per EP rank); and the runner (its caches hold the script's
    sequences)."""
    cache = HybridCache.allocate(layout.cache_config(model.config), len(SLOTS), len(SLOTS) * ROW, PAGE,
                                 torch.float32, device="cpu", dcp_size=layout.dcp_size)
    runner = ModelRunner(model, cache, PageTable(len(SLOTS), ROW, 0, "cpu"), None, balancer=balancer)
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in SEQUENCES}
    windows = []
    for step, chunks in zip(steps(layout.dp_size), step_chunks(layout.dp_size)):
        for (name, _, _), logits in zip(chunks, runner.execute(step)):
            if logits is not None:       # under pipeline parallelism only rank 0 gets logits (under DP attention
                # every rank gets every group's)
                rows[name].append(logits)
        if balancer is not None and balancer.steps % balancer.window == 0:
            windows.append(balancer.rank_load)
    out = {name: torch.cat(parts) for name, parts in rows.items() if parts}
    if balancer is not None:
        out["rank_load"] = windows
    if runner.link is not None:
        out["stage_bytes_sent"] = dict(runner.link.bytes_sent)
    return out, runner


@torch.inference_mode()
def mtp_logits(model: KimiForCausalLM) -> torch.Tensor:
    """The MTP layer's draft logits along A (plain forward)."""
    batch = ForwardBatch.build([len(A) - 1])
    ids = torch.tensor(A)
    return model.mtp_logits(model(ids[:-1], batch), ids[1:], batch)


@torch.inference_mode()
def oracle(model: KimiForCausalLM) -> dict[str, torch.Tensor]:
    """Each whole sequence's logits from one plain forward of the single-process model."""
    out = {}
    for name, ids in SEQUENCES.items():
        hidden = model(torch.tensor(ids), ForwardBatch.build([len(ids)]))
        out[name] = model.compute_logits(hidden)
    return out


def allocated_pools(args, par, control) -> dict[str, int]:
    """What the engine's load_shard plans and allocates on this rank for args (all ranks call it together)."""
    from kestrel.engine.ranks import load_shard

    shard = load_shard(args, par, torch.device("cpu"), control)
    return {"weight_bytes": shard.plan.weight_bytes, "plan_slots": shard.plan.num_slots,
            "plan_kv_tokens": shard.plan.kv_tokens, "table_rows": shard.page_table.rows.shape[0],
            "slots": [state.recurrent.shape[0] for state in shard.cache.kda],        # per KDA layer of the rank
            "kv_tokens": [layer.latent.values.shape[0] for layer in shard.cache.mla]}    # per MLA layer


def rank_main(spec, cases: list[tuple[str, str, int, int, int, int, int, bool, int]], out: str, pool_args: dict,
              eplb_window: int) -> None:
    """One rank of the test's group: for each case (name, model folder, tp_size, ep_size, pp_size, dcp_size,
    dp_size with DP attention, the all-to-all MoE, redundant experts: then EPLB rebalances every eplb_window
    steps), this rank's shard runs the script (and the MTP layer, in one stage), its share of
    A's state is gathered (not under DP attention, which PD refuses), then the engine loads the case (EngineArgs of
    pool_args) and allocates its pools; rank 0 saves every case's logits and every rank's pools to out."""
    import torch.distributed as dist

    from kestrel.distributed.launch import dcp_groups, dp_groups, init_process_groups, tp_group
    from kestrel.distributed.parallel import Parallel
    from kestrel.engine.args import EngineArgs
    from kestrel.models.checkpoint import load_model

    torch.set_num_threads(1)
    _, control = init_process_groups(spec, ParallelLayout(spec.world_size, 1, spec.rank), torch.device("cpu"),
                                     timeout_s=120)
    results = {}
    for name, folder, tp, ep, pp, dcp, dp, a2a, redundant in cases:
        layout = ParallelLayout(tp, ep, spec.rank, pp, dcp, dp, a2a, redundant)
        par = Parallel(layout, tp_group(layout), dcp_groups=dcp_groups(layout), dp_groups=dp_groups(layout))
        model = load_model(folder, torch.float32, "cpu", par)
        balancer = ExpertBalancer(model, par, eplb_window, True) if redundant else None
        results[name], runner = run_script(model, layout, balancer)
        results[name]["bytes_sent"] = dict(par.bytes_sent)
        if dp == 1:
            entries = [None] * spec.world_size
            dist.all_gather_object(entries, runner.read(Save([[]], handoff_parts_of_a())), group=control)
            results[name]["handoff"] = gather_entry(entries, layout, model.config)
        if model.config.num_nextn_predict_layers and pp == 1:
            results[name]["mtp"] = mtp_logits(model)
        pools = allocated_pools(EngineArgs(model=folder, tp_size=tp, ep_size=ep, pp_size=pp, dcp_size=dcp,
                                           dp_size=dp, enable_dp_attention=dp > 1,
                                           moe_a2a_backend="torch" if a2a else "none", **pool_args), par, control)
        gathered = [None] * spec.world_size
        dist.all_gather_object(gathered, pools, group=control)
        results[name]["pools"] = gathered
    if spec.rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()
