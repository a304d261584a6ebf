"""Running a benchmark: closed loop (a concurrency cap) or open loop (Poisson arrivals), warm-up, a request or
time bound, agentic lanes that replay sessions; one result per concurrency, as JSON plus a Markdown summary, each
with the server's prefix-cache hit rate next to the workload's theoretical maximum (prefix.py).

Each concurrency level of the random and agentic workloads sends prompts of its own (seeded by the run's seed and
the level): the server's prefix cache still holds the earlier levels' prompts, so levels sharing prompts would
measure cache hits the maximum does not count, and a time to first token the workload does not have."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from .agentic import AgenticShape, Chain, Session, describe, sessions
from .client import Client, RequestSpec, ServerError, server_info
from .metrics import RequestRecord, summarize
from .prefix import prefix_cache_report, tokenize_bodies
from .speculative import speculative_report
from .workloads import FileWorkload, RandomWorkload


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    model: str
    workload: str                      # random | agentic | file
    num_prompts: int
    concurrency: int
    request_rate: float | None = None  # open loop (requests/s, Poisson); None: closed loop
    duration_s: float | None = None    # stop dispatching after this long (in-flight requests finish)
    warmup: int = 1
    num_gpus: int = 1
    seed: int = 0
    api_key: str | None = None


async def run_requests(config: RunConfig, warmup: list[RequestSpec], specs: list[RequestSpec],
                       progress: bool) -> dict:
    """Send the warm-up requests, then the measured ones; the run's records, duration and request bodies (in
    dispatch order, warm-up included)."""
    client = Client(config.base_url, config.model, config.api_key)
    try:
        for spec in warmup:
            await client.send(spec)
        client.clock_start = time.perf_counter()
        records: list[RequestRecord] = []
        limit = asyncio.Semaphore(config.concurrency)
        rng = random.Random(config.seed)
        bar = tqdm(total=len(specs), disable=not progress, desc=f"c={config.concurrency}", unit="req")

        async def one(spec: RequestSpec) -> None:
            async with limit:
                record, _ = await client.send(spec)
                records.append(record)
                bar.update(1)

        tasks = []
        for spec in specs:
            if config.duration_s is not None and client.now() > config.duration_s:
                break
            tasks.append(asyncio.create_task(one(spec)))
            if config.request_rate:
                await asyncio.sleep(rng.expovariate(config.request_rate))
        await asyncio.gather(*tasks)
        bar.close()
        sent = [s.body for s in warmup] + [s.body for s in specs[:len(tasks)]]
        return {"records": records, "duration_s": client.now(), "bodies": sent}
    finally:
        await client.close()


async def run_agentic(config: RunConfig, all_sessions: list[Session], think_scale: float, progress: bool) -> dict:
    """`concurrency` lanes, each replaying whole sessions (sub-agents included) one after another."""
    client = Client(config.base_url, config.model, config.api_key)
    records: list[RequestRecord] = []
    bodies: list[dict] = []
    queue = list(reversed(all_sessions))
    dispatched = 0
    bar = tqdm(total=config.num_prompts, disable=not progress, desc=f"lanes={config.concurrency}", unit="req")

    def budget_left() -> bool:
        within_time = config.duration_s is None or client.now() < config.duration_s
        return within_time and dispatched < config.num_prompts

    async def chain(c: Chain) -> None:
        nonlocal dispatched
        for turn in c.turns:
            await asyncio.sleep(turn.think_before * think_scale)
            if not budget_left():
                return
            dispatched += 1
            body = {"messages": turn.messages, "max_tokens": turn.max_tokens, "ignore_eos": True, "temperature": 0}
            bodies.append(body)
            record, _ = await client.send(RequestSpec("chat", body))
            records.append(record)
            bar.update(1)
            if turn.spawn:
                await asyncio.gather(*(chain(child) for child in turn.spawn))

    async def lane() -> None:
        while queue and budget_left():
            await chain(queue.pop().main)

    try:
        await asyncio.gather(*(lane() for _ in range(config.concurrency)))
        bar.close()
        return {"records": records, "duration_s": client.now(), "bodies": bodies}
    finally:
        await client.close()


def _server_info_or_error(config: RunConfig) -> dict:
    """Server info after a run; a server that went away mid-run must not cost the results."""
    try:
        return asyncio.run(server_info(config.base_url, config.api_key))
    except ServerError as e:
        return {"error": str(e)}


def _prefix_cache(config: RunConfig, run: dict, before: dict, after: dict) -> dict:
    """prefix.prefix_cache_report of a run (read after the run's last /metrics, so tokenizing counts nothing)."""
    try:
        prompts, error = tokenize_bodies(config.base_url, run["bodies"], config.api_key), None
    except ServerError as e:
        prompts, error = None, str(e)
    return prefix_cache_report(before.get("metrics"), after.get("metrics"), prompts, error)


def result_document(config: RunConfig, run: dict, workload: dict, command: list[str], before: dict,
                    after: dict) -> dict:
    metrics = summarize(run["records"], run["duration_s"], config.num_gpus)
    return {"command": command, "config": {k: v for k, v in asdict(config).items() if k != "api_key"},
            "workload": workload, "partial": metrics["failed"] > 0 or "error" in after,
            "server_before": before, "server_after": after, "metrics": metrics,
            "prefix_cache": _prefix_cache(config, run, before, after),
            "speculative": speculative_report(before.get("metrics"), after.get("metrics")),
            "requests": [asdict(r) for r in run["records"]]}


def level_seed(seed: int, concurrency: int) -> int:
    """The seed of one concurrency level's prompts, drawn from the run's seed and the level."""
    return random.Random(f"{seed}/c{concurrency}").getrandbits(32)


def run_sweep(config: RunConfig, concurrencies: list[int], output: Path, command: list[str], *, input_len: int,
              output_len: int, range_ratio: float, file: Path | None, shape: AgenticShape, think_scale: float,
              progress: bool = True) -> list[Path]:
    """One run per concurrency; writes <output>/<workload>-c<C>.json and <output>/summary.md."""
    output.mkdir(parents=True, exist_ok=True)
    written = []
    for concurrency in concurrencies:
        run_config = RunConfig(**{**asdict(config), "concurrency": concurrency})
        before = asyncio.run(server_info(config.base_url, config.api_key))
        seed = level_seed(config.seed, concurrency)
        if config.workload == "agentic":
            level_shape = replace(shape, seed=seed)
            corpus = sessions(level_shape)
            workload = {"name": "agentic", "shape": asdict(level_shape), "think_scale": think_scale,
                        "generated": describe(corpus)}
            run = asyncio.run(run_agentic(run_config, corpus, think_scale, progress))
        else:
            if config.workload == "random":
                generator = RandomWorkload(input_len, output_len, range_ratio, seed)
                specs = generator.requests(config.num_prompts + config.warmup, config.base_url, config.api_key)
                workload = {"name": "random", **asdict(generator)}
            else:
                specs = FileWorkload(file, output_len).requests(config.num_prompts + config.warmup)
                workload = {"name": "file", "path": str(file), "output_len": output_len}
            run = asyncio.run(run_requests(run_config, specs[:config.warmup], specs[config.warmup:], progress))
        after = _server_info_or_error(config)
        document = result_document(run_config, run, workload, command, before, after)
        path = output / f"{config.workload}-c{concurrency}.json"
        path.write_text(json.dumps(document, indent=1))
        written.append(path)
    notes = [_prompts_note(config.workload)] if len(written) > 1 else []
    (output / "summary.md").write_text(summary_markdown([json.loads(p.read_text()) for p in written], notes))
    return written


def summary_markdown(results: list[dict], notes: list[str] = ()) -> str:
    """The results' table, then any failures and the given notes (Markdown list items)."""
    rows = ["| workload | concurrency | completed | failed | req/s | output tok/s | total tok/s/GPU | "
            "TTFT median ms | TPOT median ms | ITL p90 ms | AgentX tok/s/GPU | p90 interactivity tok/s | "
            "prefix hit % (server) | prefix hit % (max) | acceptance length |",
            "|" + "---|" * 15]
    for r in results:
        m = r["metrics"]
        ms = lambda d, k: "-" if d[k] is None else f"{1000 * d[k]:.1f}"  # noqa: E731
        interactivity = m["agentx"]["p90_interactivity"]
        rows.append(f"| {r['workload']['name']} | {r['config']['concurrency']} | {m['completed']} | {m['failed']} | "
                    f"{m['request_throughput']:.2f} | {m['output_throughput']:.1f} | "
                    f"{m['total_token_throughput_per_gpu']:.1f} | {ms(m['ttft_s'], 'median')} | "
                    f"{ms(m['tpot_s'], 'median')} | {ms(m['itl_s'], 'p90')} | {m['agentx']['total_tput_per_gpu']:.1f} | "
                    f"{'-' if interactivity is None else f'{interactivity:.1f}'} | {_hit_rates(r)} | "
                    f"{_acceptance(r)} |")
    failures = {k: v for r in results for k, v in r["metrics"]["failure_reasons"].items()}
    notes = ([f"- failures: {failures}"] if failures else []) + list(notes)
    return "\n".join(["# Benchmark summary", "", *rows, "", *notes]) + "\n"


def _prompts_note(workload: str) -> str:
    """A sweep summary's line on whether its levels sent prompts of their own (see the module's docstring)."""
    if workload == "file":
        return ("- every concurrency level sent the file's prompts: after the first, the server's prefix cache "
                "holds them from earlier levels, so hits can pass the maximum and TTFT is that of cached prompts")
    return "- each concurrency level sent prompts of its own, seeded by --seed and the level"


def _acceptance(result: dict) -> str:
    """The run's mean acceptance length ('-' without speculative decoding or counters)."""
    length = (result.get("speculative") or {}).get("acceptance_length")
    return "-" if length is None else f"{length:.2f}"


def _hit_rates(result: dict) -> str:
    """'server | max' percentages of a result's prefix_cache ('-' where unknown; results of older versions have
    none)."""
    cache = result.get("prefix_cache") or {}
    server = (cache.get("server") or {}).get("hit_rate")
    best = (cache.get("theoretical") or {}).get("max_hit_rate")
    return " | ".join("-" if x is None else f"{100 * x:.1f}" for x in (server, best))
