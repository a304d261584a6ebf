"""`kestrel serve --tp-size 2` on the bundled model, run as users run it (here with WideEP's flags: the experts over
both ranks, tokens dispatched all-to-all, EPLB every 2 steps): the same greedy completion as one process, the
expert load per EP rank in /metrics, and SIGTERM stops the server and every rank it spawned (exit code 0, no process
left)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx

from kestrel import LLM
from kestrel.engine.args import BUNDLED_MODEL
from kestrel.engine.sampling import SamplingParams
from server_helpers import start_kestrel_serve

PROMPT = "Once upon a time"
ARGS = {"dtype": "float32", "max_total_tokens": 4096, "max_mamba_cache_size": 8}


def descendants(pid: int) -> set[int]:
    """Every process below pid (read from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_serve_tp2_completes_like_one_process_and_sigterm_stops_every_rank():
    expected = LLM(str(BUNDLED_MODEL), **ARGS).generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()]
    process, url = start_kestrel_serve("--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "torch",
                                       "--enable-eplb", "--ep-num-redundant-experts", "2",
                                       "--eplb-rebalance-num-iterations", "2", *flags)
    try:
        ranks = descendants(process.pid)
        assert ranks
        reply = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": BUNDLED_MODEL.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
        assert reply["choices"][0]["text"] == expected[0].outputs[0].text
        metrics = dict(line.rsplit(" ", 1) for line in httpx.get(url + "/metrics").text.splitlines()
                       if line.startswith("kestrel_e"))
        assert float(metrics["kestrel_eplb_rebalances"]) >= 1
        per_rank = [float(metrics[f'kestrel_expert_rank_tokens{{ep_rank="{r}"}}']) for r in (0, 1)]
        assert sum(per_rank) > 0
        assert float(metrics["kestrel_expert_load_imbalance"]) == max(per_rank) / (sum(per_rank) / 2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        process.kill()
        process.communicate()
    assert not _alive(ranks, wait_s=30)


def _alive(pids: set[int], wait_s: float) -> set[int]:
    """Which of pids still run (not zombies) after waiting up to wait_s for them to exit."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = set()
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.add(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)
