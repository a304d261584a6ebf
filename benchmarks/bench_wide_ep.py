"""WideEP: the all-reduce MoE against the all-to-all MoE with DP attention, EPLB on a skewed router, and K3.1 Pro's
MoE bytes per token on both paths (beside bench_distributed.py's section, which measures the TP/DCP/PP traffic).

1. Four gloo ranks (kestrel.LLM, one process per rank, on this machine's cores) serving the 437M-parameter K3 of
   bench_llamacpp.py (64 MXFP4 experts, top-4, float32) in three layouts: TP4 x EP4 (attention split four ways, one
   all-reduce per MoE layer), DP4 attention x EP4 with the all-reduce MoE (every rank holds every group's tokens
   after each attention layer), and DP4 attention x EP4 with the all-to-all MoE (a token's stream stays with its
   group; only its expert inputs travel). REQUESTS greedy requests of PROMPT prompt and OUTPUT output tokens, best of
   ROUNDS: output tok/s; and over the decode steps alone (every request prefilled), rank 0's bytes per step by
   collective (Parallel.bytes_sent) next to the formula's (kestrel/distributed/traffic.py; the all-to-all rows at
   the expected pairs of uniform routing, the measured ones follow the model's actual routing).
2. The same model with its router bias raised by HOT_BIAS on HOT experts, all held by EP rank 0 at load: the
   token-expert pairs each EP rank computed over the last window of WINDOW steps (the engine's ExpertBalancer, what
   /metrics shows), max / mean, with EPLB off and on (REDUNDANT redundant experts, rebalancing every WINDOW steps).
3. K3.1 Pro at EP32 and EP64, from the formulas: MoE bytes per token over all ranks, both paths, with attention TP
   1 and 8.
Writes the section "wide-ep" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_wide_ep.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_llamacpp import random_437m  # noqa: E402
from benchmarks.report import THREADS, machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel import LLM, SamplingParams  # noqa: E402
from kestrel.cookbook.model import resolve_config  # noqa: E402
from kestrel.cookbook.moe_traffic import STEP_TOKENS, moe_traffic_rows  # noqa: E402
from kestrel.distributed.traffic import (Forward, a2a_traffic, dp_attention_traffic, expected_a2a_pairs,  # noqa: E402
                                         tp_traffic)
from kestrel.models.checkpoint import load_model, save_model  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_wide_ep.py"
ROUNDS, REQUESTS, PROMPT, OUTPUT = 2, 8, 32, 32
HOT, HOT_BIAS, REDUNDANT, WINDOW = (0, 1, 2, 3, 4, 5), 0.3, 8, 16
SKEWED_OUTPUT = 64
ENGINE = dict(dtype="float32", max_total_tokens=8192, max_mamba_cache_size=16, disable_radix_cache=True,
              mem_fraction_static=0.25)
LAYOUTS = {"TP4 x EP4, all-reduce MoE": dict(tp_size=4, ep_size=4),
           "DP4 attention x EP4, all-reduce MoE": dict(tp_size=4, ep_size=4, dp_size=4, enable_dp_attention=True),
           "DP4 attention x EP4, all-to-all MoE": dict(tp_size=4, ep_size=4, dp_size=4, enable_dp_attention=True,
                                                       moe_a2a_backend="torch")}


def prompts(seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 32000, (PROMPT,), generator=gen).tolist()} for _ in range(REQUESTS)]


def decode_bytes(llm: LLM, batch: list[dict], output: int) -> tuple[Counter, int]:
    """Rank 0's bytes by collective over the decode steps of one run of batch (the steps after every request has
    its first token), and how many such steps ran."""
    engine, counter = llm.engine, llm.engine.model.par.bytes_sent
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    for i, prompt in enumerate(batch):
        engine.add_request(f"bytes-{i}", prompt["prompt_token_ids"], params)
    started: set[str] = set()
    total, steps = Counter(), 0
    while engine.has_unfinished_requests():
        before = Counter(counter)
        decoding = len(started) == len(batch)
        outputs = engine.step()
        if decoding:
            total.update(Counter(counter) - before)
            steps += 1
        started |= {o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids}
    return total, steps


def throughput(folder: Path) -> tuple[list[list[object]], list[list[object]]]:
    """Rows of output tok/s per layout, and of decode-step bytes per collective (counted and by the formula)."""
    config = resolve_config(str(folder))
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    speed, traffic = [], []
    for name, sizes in LAYOUTS.items():
        llm = LLM(str(folder), **ENGINE, **sizes)
        try:
            llm.generate(prompts(99)[:2], SamplingParams(temperature=0, max_tokens=2))      # warm-up
            best = float("inf")
            for r in range(ROUNDS):
                start = time.perf_counter()
                llm.generate(prompts(r), params)
                best = min(best, time.perf_counter() - start)
            counted, steps = decode_bytes(llm, prompts(7), OUTPUT)
        finally:
            llm.engine.shutdown()
        speed.append([name, f"{best:.1f} s", f"{REQUESTS * OUTPUT / best:,.1f}"])
        expected = expected_step_bytes(config, sizes, context=PROMPT + OUTPUT // 2)
        for kind in sorted(set(counted) | set(expected)):
            traffic.append([name, kind, f"{counted.get(kind, 0) / max(steps, 1):,.0f}",
                            f"{expected.get(kind, 0):,.0f}"])
    return speed, traffic


def expected_step_bytes(config, sizes: dict, context: int) -> dict[str, float]:
    """The formula's bytes from rank 0 for one decode step of REQUESTS sequences at `context` tokens (DP groups
    holding REQUESTS / dp each; the all-to-all at the expected pairs of uniform routing)."""
    tp, dp = sizes["tp_size"], sizes.get("dp_size", 1)
    if dp == 1:
        return tp_traffic(config, tp, Forward.decode(REQUESTS, context), 4)
    groups = [Forward.decode(REQUESTS // dp, context)] * dp
    if sizes.get("moe_a2a_backend", "none") == "none":
        return dp_attention_traffic(config, tp, dp, groups, 0, 4)
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    pairs = expected_a2a_pairs(config, tp, sizes["ep_size"]) * groups[0].tokens * moe_layers
    return a2a_traffic(config, tp, dp, groups, 0, 4, round(pairs), round(pairs))


def skewed(folder: Path, out: Path) -> Path:
    """folder's model with its router bias raised by HOT_BIAS on the HOT experts (all on EP rank 0 at EP4)."""
    model = load_model(folder, torch.float32)
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.data[list(HOT)] += HOT_BIAS
    save_model(model, out, config_json=json.loads((folder / "config.json").read_text()))
    return out


def balance(folder: Path) -> list[list[object]]:
    """Rows: EPLB off / on, the last window's pairs per EP rank, max / mean, rebalances, output tok/s."""
    rows = []
    params = SamplingParams(temperature=0, max_tokens=SKEWED_OUTPUT, ignore_eos=True)
    for eplb in (False, True):
        extra = dict(enable_eplb=True, ep_num_redundant_experts=REDUNDANT) if eplb else {}
        llm = LLM(str(folder), **ENGINE, **LAYOUTS["DP4 attention x EP4, all-to-all MoE"], **extra,
                  eplb_rebalance_num_iterations=WINDOW)
        try:
            start = time.perf_counter()
            llm.generate(prompts(3), params)
            seconds = time.perf_counter() - start
            balancer = llm.engine.runner.balancer
            rows.append(["on" if eplb else "off", REDUNDANT if eplb else 0, " / ".join(map(str, balancer.rank_load)),
                         f"{balancer.imbalance:.2f}", balancer.rebalances, f"{REQUESTS * SKEWED_OUTPUT / seconds:,.1f}"])
        finally:
            llm.engine.shutdown()
    return rows


def k31_pro() -> list[list[object]]:
    """K3.1 Pro's MoE bytes per token (bf16) over all ranks at EP32 and EP64 = TP, attention TP 1 and 8, both
    paths (kestrel.cookbook.moe_traffic, a decode step of its STEP_TOKENS tokens)."""
    rows = moe_traffic_rows(resolve_config("k3.1-pro"), (32, 64), (1, 8), 2)
    return [[f"EP{ep} = TP{ep}, attention TP {attn} (DP{ep // attn})", f"{reduce / 1e6:,.2f} MB", f"{a2a / 1e6:,.2f} MB",
             f"{a2a / reduce:.3f}"] for ep, attn, reduce, a2a in rows]


def main() -> None:
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        folder = random_437m(Path(tmp) / "k3-437m")
        speed, traffic = throughput(folder)
        balanced = balance(skewed(folder, Path(tmp) / "k3-437m-skewed"))
    pro = k31_pro()
    body = "\n\n".join([
        f"## WideEP: all-to-all MoE, DP attention, EPLB\n\n`{COMMAND}` ({machine()})",
        f"Four gloo ranks (one process each, rank 0 on {THREADS} torch thread, the others on their share of this "
        f"machine's cores) serving bench_llamacpp's 437M-parameter K3 (64 MXFP4 experts, top-4, float32) through "
        f"`kestrel.LLM`: {REQUESTS} greedy requests of {PROMPT} prompt and {OUTPUT} output tokens, best of {ROUNDS}.",
        markdown_table(["layout", "time", "output tok/s"], speed),
        f"Rank 0's bytes per decode step ({REQUESTS} sequences; the steps after every request's first token), "
        "counted by the engine (`Parallel.bytes_sent`), and the formula's for a step at the run's mean context "
        "(kestrel/distributed/traffic.py; all-to-all rows at the expected pairs of uniform routing, so they differ "
        "from the counted ones by how this model routes; the all-reduce rows' indexer-free MLA layers do not depend "
        "on the context).",
        markdown_table(["layout", "collective", "counted per step", "formula per step"], traffic),
        f"The same model with its router bias raised by {HOT_BIAS} on experts {', '.join(map(str, HOT))} (all on EP "
        f"rank 0 at load), DP4 attention x EP4 with the all-to-all MoE, {REQUESTS} requests of {SKEWED_OUTPUT} "
        f"output tokens; the token-expert pairs each EP rank computed over the last {WINDOW}-step window "
        f"(`kestrel_expert_rank_tokens` in /metrics) with EPLB off and on ({REDUNDANT} redundant experts, "
        f"rebalancing every {WINDOW} steps).",
        markdown_table(["EPLB", "redundant experts", "pairs per EP rank, last window", "max / mean", "rebalances",
                        "output tok/s"], balanced),
        f"K3.1 Pro's MoE bytes per token summed over all ranks (`kestrel/cookbook/moe_traffic.py`; bf16 "
        f"activations, a {STEP_TOKENS}-token decode step; the all-reduce path's ring moves 2 (n - 1) / n of each "
        "rank's input; the all-to-all path's rows go only to the ranks holding a token's experts, at the expected "
        "pairs of uniform routing, plus their returns and the row counts, and with attention TP above 1 the shared "
        "experts' all-reduce and the routed sums' all-gather within the attention group):",
        markdown_table(["layout", "all-reduce MoE", "all-to-all MoE", "ratio"], pro),
        "On this 2-core machine four ranks share two cores and gloo runs over loopback TCP, so the times say how the "
        "paths' costs compare here, not what an interconnect gives; the bytes are what carries over.",
    ])
    print(body)
    write_section("wide-ep", body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
