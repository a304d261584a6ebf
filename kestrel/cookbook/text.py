"""Plain-text renderings of plans and recipes for the terminal (`kestrel plan`, `kestrel recipe`)."""

from __future__ import annotations

from .moe_traffic import STEP_TOKENS
from .planner import Plan
from .recipes import ENGINES, Recipe


def gb(n: float | None) -> str:
    """Bytes as decimal GB ('205.06 GB'), or 'unknown'."""
    return "unknown" if n is None else f"{n / 1e9:,.2f} GB"


def count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:,}"


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]


def _rate(value: float | None) -> str:
    return "unknown" if value is None else f"{value:,.0f}"


def _us(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds * 1e6:,.0f} us"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def _moe_path(plan: Plan) -> str:
    """Which MoE path the plan assumes, and the MoE bytes per token of each path the layout can take."""
    traffic = plan.moe_bytes_per_token
    if plan.request.layout.a2a:
        text = (f"all-to-all (--moe-a2a-backend torch): {_mb(traffic['a2a'])} of MoE traffic per token over all ranks "
                f"(the all-reduce path: {_mb(traffic['all_reduce'])}, {traffic['a2a'] / traffic['all_reduce']:.2f}x)")
    else:
        text = (f"all-reduce (--moe-a2a-backend none): {_mb(traffic['all_reduce'])} of MoE traffic per token over all "
                "ranks" + (f" (the all-to-all path: {_mb(traffic['a2a'])}, "
                           f"{traffic['a2a'] / traffic['all_reduce']:.2f}x)" if "a2a" in traffic else ""))
    return text + f" in a {STEP_TOKENS}-token step"


def roofline_caption(plan: Plan) -> str:
    """What the roofline is when the plan does not fit: a hypothetical bound, not a forecast."""
    if plan.fits is False:
        return "hypothetical: the plan does not fit, so nothing runs at these rates"
    return "memory reads and collectives: upper bounds"


def plan_text(plan: Plan) -> str:
    """The plan as a table, then the roofline, unknowns and notes."""
    request, cache, device = plan.request, plan.request.cache, plan.device
    weights = ", ".join(f"{k} {gb(v)}" for k, v in plan.weight_bytes_per_rank.items() if v)
    pools = plan.pools
    rows = [
        ("model", f"{request.model} ({plan.model.config.architecture}): {count(plan.model.total_params)} parameters, "
                  f"{count(plan.model.active_params)} active per token"),
        ("hardware", f"{device.id}: {device.name}"),
        ("memory per device", device.fact("memory").describe()),
        ("bandwidth per device", device.fact("memory_bandwidth").describe()),
        ("layout", f"{request.layout.describe()} = {plan.nodes.ranks} ranks on {plan.nodes.describe()}"),
        ("weights per rank", f"{gb(plan.weight_bytes_per_rank_total)} ({weights})"),
        ("KV per token", f"{plan.kv_bytes_per_token:,} B ({cache.kv_dtype}); per rank "
                         f"{plan.kv_bytes_per_token_per_rank:,.0f} B (/ DCP {request.layout.dcp}"
                         f"{' + draft' if cache.spec != 'none' else ''})"),
        ("KDA state per slot", f"{plan.state_bytes_per_slot:,} B ({cache.ssm_dtype}); per rank "
                               f"{plan.state_bytes_per_slot_per_rank:,} B (/ attention TP "
                               f"{request.layout.attention_tp})"
                               + (f" + ReplaySSM ring {plan.ring_bytes_per_slot_per_rank:,} B"
                                  if plan.ring_bytes_per_slot_per_rank else "")),
        ("state slots per request", f"S = {plan.slots_per_request} ({cache.radix_strategy}, {cache.mode}), "
                                    f"D = {plan.verify_states} ({cache.spec})"
                                    + (f"; conv verify windows {plan.window_bytes_per_request_per_rank:,} B per "
                                       "running request per rank" if plan.window_bytes_per_request_per_rank else "")),
        ("memory ratio", f"{plan.ratio:.4g} (balanced for {request.avg_request_len:,}-token requests: "
                         f"{plan.balanced_ratio:.4g})"),
    ]
    if pools is not None:
        rows += [("pools per rank", f"{gb(max(pools.rest_bytes, 0))} after weights: {pools.state_slots:,} state slots, "
                                   f"{pools.kv_tokens:,} KV tokens"),
                 ("concurrency cap", f"{plan.admitted_requests:,} requests ({pools.max_running_requests:,} per "
                                     "attention-DP worker)")]
    if plan.handoff_bytes is not None:
        rows.append(("PD handoff", f"{gb(plan.handoff_bytes)} per {request.avg_request_len:,}-token prompt in kestrel's "
                                   f"layout (pages of latents + indexer keys, plus the {gb(plan.state_bytes_per_slot)} "
                                   f"KDA state): R prompts/s need R x {gb(plan.handoff_bytes)}/s from prefill to decode"))
    if plan.moe_bytes_per_token:
        rows.append(("MoE path", _moe_path(plan)))
    rows.append(("fits", ("unknown" if plan.fits is None else "yes" if plan.fits else "no") + f": {plan.fit_reason}"))
    rows.append(("min devices", ", ".join(f"{k} {v if v is not None else 'unknown'}"
                                          for k, v in plan.min_devices.items())))
    lines = _rows(rows)
    context = plan.roofline[0].context if plan.roofline else request.avg_request_len
    tokens = plan.roofline[0].tokens_per_sequence if plan.roofline else 1
    lines += ["", f"decode roofline at context {context:,}, {tokens} token(s) per sequence per step "
                  f"({roofline_caption(plan)})",
              f"{'batch':>6} {'weights/step':>14} {'KV/step':>11} {'index/step':>11} {'state/step':>11} "
              f"{'comm/step':>10} {'tok/s/user':>11} {'tok/s/GPU':>10} {'KV>weights at':>14} {'index>weights at':>17} "
              f"{'index/weights @max ctx':>23}"]
    for step, cross in zip(plan.roofline, plan.crossovers):
        ratio = cross.indexer_to_weights_at_max_context
        at_max = "-" if ratio is None else f"{ratio:.2f}x"
        lines.append(f"{step.batch:>6} {gb(step.weight_bytes):>14} {gb(step.kv_bytes):>11} "
                     f"{gb(step.index_key_bytes):>11} {gb(step.state_bytes):>11} {_us(step.comm_seconds):>10} "
                     f"{_rate(step.tokens_per_s_per_user):>11} "
                     f"{_rate(step.tokens_per_s_per_device):>10} "
                     f"{'-' if cross.kv_context is None else f'{cross.kv_context:,}':>14} "
                     f"{'-' if cross.indexer_context is None else f'{cross.indexer_context:,}':>17} {at_max:>23}")
    lines += ["", *_context_cost_lines(plan)]
    if plan.unknowns:
        lines += ["", "unknown (and what it blocks):"]
        lines += [f"  {u.fact}: {u.source} -> blocks {', '.join(u.blocks)}" for u in plan.unknowns]
    lines += ["", "notes:", *(f"  - {n}" for n in plan.notes)]
    return "\n".join(lines)


def _context_cost_lines(plan: Plan) -> list[str]:
    """What one token of one sequence costs at the roofline's context beyond the weights: the indexer's scan, the
    selected keys' attention, the KDA state (kestrel.cookbook.context_cost), with times where the device's speed is
    known."""
    cost, speed = plan.context_cost, plan.rank_speed

    def row(name: str, nbytes: float | None, flops: float, seconds: float | None) -> str:
        return (f"{name:<26} {'-' if nbytes is None else _mb(nbytes):>12} {flops / 1e6:>12,.2f} "
                f"{'unknown' if seconds is None else f'{seconds * 1e3:,.3f} ms':>14}")

    lines = [f"per token at context {cost.context:,}, what depends on the context (one sequence, one rank; "
             f"attention over {cost.selected:,} keys)",
             f"{'':<26} {'bytes':>12} {'MFLOP':>12} {'time at least':>14}"]
    parts = (("indexer scan", cost.index_scan), ("selected-key attention", cost.attention),
             ("KDA state", cost.kda_state))
    lines += [row(name, part.bytes, part.flops, None if speed is None else part.seconds(*speed))
              for name, part in parts if part.flops]
    lines.append(row("decode token", cost.decode.bytes, cost.decode.flops,
                     None if speed is None else cost.decode_seconds(*speed)))
    lines.append(row(f"prompt token ({cost.context:,})", None, cost.prefill_index_flops + cost.prefill_attention_flops,
                     None if speed is None else cost.prefill_seconds(speed[1])))
    return lines


def recipe_text(recipe: Recipe) -> str:
    """The recipe's commands per engine (or why an engine has none), then the plan summary."""
    plan = recipe.plan
    lines = [f"recipe {recipe.id}",
             f"  lane: {recipe.lane}; SGLang page: {recipe.sglang_status or 'no SGLang cell'}",
             f"  layout: {plan.request.layout.describe()} on {recipe.nodes} x {recipe.per_node} "
             f"({plan.nodes.devices} device{'s' if plan.nodes.devices != 1 else ''})",
             f"  memory ratio pinned: {recipe.ratio_text} (average request {plan.request.avg_request_len:,} tokens)",
             f"  plan: {gb(plan.weight_bytes_per_rank_total)} weights per rank; "
             + (f"{plan.pools.kv_tokens:,} KV tokens and {plan.admitted_requests:,} requests admitted"
                if plan.pools else "pools unknown")]
    for engine in ENGINES:
        lines.append("")
        if engine in recipe.refusals:
            lines.append(f"{engine}: no command: {recipe.refusals[engine]}")
            continue
        command = recipe.commands[engine]
        lines.append(f"{engine}" + (f" ({command.strategy})" if command.strategy else "")
                     + (f", image {command.image}" if command.image else "") + ":")
        lines += [f"  {line}" for line in command.lines]
        lines += [f"  note: {n}" for n in command.notes]
    lines += [f"\nnote: {n}" for n in recipe.notes]
    return "\n".join(lines)
