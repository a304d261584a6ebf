"""Long prompts end to end on the bundled model (issue 62): prefix caching, PD handoff and the fp8 cache at a long
context, each against one engine computing the same prompt cold.

At `--context` tokens (default 131,072; the bundled model's indexer keeps 64 keys, so its two sparse MLA layers
select among all of them), with one random prompt P:
1. cold: an engine without a prefix cache answers P (greedy, `--new` tokens, the chosen tokens' logprobs), then
   the next turn P + answer + 64 new tokens;
2. prefix cache: an engine with one (kestrel's defaults) answers P, then P again (every prompt token but the last
   from the cache: the pages and the KDA state snapshot saved where P ended), then the next turn (a hit through
   the first answer); each answer against the cold one;
3. PD: a prefill engine computes P and hands it off (kestrel.disagg.wire's bytes: the header frame and the raw
   tensors, each checked against its CRC-32), a decode engine continues; the tensor bytes against the plan's
   `handoff_bytes` for a P-token prompt (kestrel.disagg.size), the answer against the cold one;
4. fp8: the cold engine with `kv_cache_dtype="fp8_e4m3"` (fp8 latents and indexer keys, a scale per row).

Every engine runs with `enable_deterministic_inference=True` (batch-invariant operators: a token's numbers do not
depend on what else its step computes, so a prefix hit, which computes the last prompt token alone where the cold
engine computed it inside a chunk, must give the same bits). Equal answers: the same greedy tokens and every chosen
token's logprob exactly equal. fp8 rounds every cached value: its row reports how many greedy tokens agree with the
bfloat16 cache's and the largest logprob difference, no bound. Writes the section "long-context-checks" of
docs/benchmarks.md.

Run: .venv/bin/python benchmarks/check_long_context.py [--context 131072] [--new 16] [--no-write]
About 20 minutes at 131,072 tokens on 2 cores (five long prefills, every engine deterministic).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import machine, markdown_table, write_section  # noqa: E402
from kestrel import LLM, SamplingParams  # noqa: E402
from kestrel.disagg.size import handoff_bytes  # noqa: E402
from kestrel.disagg.wire import read_frame, read_handoff, write_handoff  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL, EngineArgs  # noqa: E402
from kestrel.engine.engine import LLMEngine  # noqa: E402
from kestrel.engine.handoff import Handoff  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/check_long_context.py"
POOL_FRACTION = 0.05
"""Each engine's share of RAM (weights and pools): five engines in one process."""
TURN_TOKENS = 64


class Answer:
    """A request's greedy tokens, their logprobs and how many prompt tokens came from the cache."""

    def __init__(self, output) -> None:
        completion = output.outputs[0]
        self.tokens = completion.token_ids
        self.logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]
        self.cached = output.num_cached_tokens

    def against(self, cold: Answer) -> tuple[int, float]:
        """(greedy tokens equal to cold's before the first difference, largest |logprob difference| over them)."""
        same = next((i for i, (a, b) in enumerate(zip(self.tokens, cold.tokens)) if a != b), len(self.tokens))
        diffs = [abs(a - b) for a, b in zip(self.logprobs[:same], cold.logprobs[:same])]
        return same, max(diffs, default=0.0)


def engine_args(context: int, **changes) -> dict:
    return dict(model=str(BUNDLED_MODEL), context_length=context + 1024, mem_fraction_static=POOL_FRACTION,
                enable_deterministic_inference=True, **changes)


def answer(llm: LLM, ids: list[int], params: SamplingParams) -> Answer:
    return Answer(llm.generate({"prompt_token_ids": ids}, params)[0])


class Buffer:
    """An asyncio writer into memory (what kestrel.disagg.wire writes to a socket)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data) -> None:
        self.data += data

    async def drain(self) -> None:
        """Nothing to wait for: memory takes every byte as it is written."""


async def over_the_wire(handoff: Handoff) -> tuple[Handoff, int]:
    """handoff written as kestrel.disagg.wire sends it and read back: (the handoff received, its tensor bytes)."""
    buffer = Buffer()
    sent = await write_handoff(buffer, handoff)
    reader = asyncio.StreamReader()
    reader.feed_data(bytes(buffer.data))
    reader.feed_eof()
    return await read_handoff(reader, await read_frame(reader)), sent


def run_engine(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def pd(context: int, ids: list[int], params: SamplingParams) -> tuple[Answer, int, int]:
    """P through a prefill engine, the wire and a decode engine: (the answer, tensor bytes sent, the bytes
    kestrel.disagg.size.handoff_bytes gives for the prefill engine's model, page size and dtypes)."""
    prefiller = LLMEngine(EngineArgs(**engine_args(context)))
    handed: list[Handoff] = []
    prefiller.add_request("prefill", ids, params, handoff=handed.append)
    run_engine(prefiller)
    received, sent = asyncio.run(over_the_wire(handed[0]))
    cache = prefiller.cache
    planned = handoff_bytes(prefiller.config, len(ids), cache.page_size, next(prefiller.model.parameters()).dtype,
                            kv_dtype=cache.mla[0].latent.values.dtype)
    del prefiller
    decoder = LLMEngine(EngineArgs(**engine_args(context)))
    decoder.add_prefilled_request("decode", received, params)
    return Answer(run_engine(decoder)["decode"]), sent, planned


def check(context: int, new: int) -> dict:
    prompt = torch.randint(10, 4000, (context,), generator=torch.Generator().manual_seed(62)).tolist()
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=1)
    follow = torch.randint(10, 4000, (TURN_TOKENS,), generator=torch.Generator().manual_seed(63)).tolist()
    began = time.perf_counter()
    cold_llm = LLM(**engine_args(context, disable_radix_cache=True))
    cold = answer(cold_llm, prompt, params)
    turn = prompt + cold.tokens + follow
    cold_turn = answer(cold_llm, turn, params)
    del cold_llm
    warm_llm = LLM(**engine_args(context))
    first, repeat, next_turn = (answer(warm_llm, ids, params) for ids in (prompt, prompt, turn))
    del warm_llm
    handed, sent, planned = pd(context, prompt, params)
    fp8 = answer(LLM(**engine_args(context, disable_radix_cache=True, kv_cache_dtype="fp8_e4m3")), prompt, params)
    rows = {"prefix cache, first time": (first, cold), "prefix cache, P again": (repeat, cold),
            "prefix cache, next turn": (next_turn, cold_turn), "PD (prefill -> wire -> decode)": (handed, cold),
            "fp8 latents and indexer keys": (fp8, cold)}
    return {"context": context, "new": new, "seconds": time.perf_counter() - began, "sent": sent,
            "planned": planned, "turn": len(turn),
            "rows": {name: dict(zip(("same", "diff"), a.against(b)), cached=a.cached)
                     for name, (a, b) in rows.items()}}


def report(result: dict) -> str:
    new = result["new"]

    def verdict(name: str, row: dict) -> str:
        if name.startswith("fp8"):
            return "reported"
        return "equal" if row["same"] == new and row["diff"] == 0 else "DIFFERENT"

    rows = [[name, f"{row['cached']:,}", f"{row['same']} / {new}", f"{row['diff']:.2e}", verdict(name, row)]
            for name, row in result["rows"].items()]
    sent, planned = result["sent"], result["planned"]
    return "\n\n".join([
        f"## Long prompts end to end (`{COMMAND}`)",
        f"The bundled model (indexer top-64) with a {result['context']:,}-token random prompt P, {new} greedy tokens "
        f"with their logprobs, each engine against one without a prefix cache computing the same prompt cold (the "
        f"next turn: P + the answer + {TURN_TOKENS} tokens, {result['turn']:,} in all), all with "
        "`--enable-deterministic-inference`. Equal: the same tokens and every logprob the same bits; fp8 is "
        "reported against the bfloat16 cache, not bounded.",
        markdown_table(["engine", "prompt tokens from the cache", "greedy tokens equal to cold", "largest |logprob "
                        "difference|", "verdict"], rows),
        f"PD handoff of P: {sent / 2**20:,.1f} MiB of tensors sent over kestrel.disagg.wire (CRC-32 checked), the "
        f"plan's `handoff_bytes`: {planned / 2**20:,.1f} MiB ({'equal' if sent == planned else 'DIFFERENT'}).",
        f"{machine()}; {result['seconds']:.0f} s. Rerun: `{COMMAND}`"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--no-write", action="store_true", help="print the section, leave docs/benchmarks.md alone")
    args = parser.parse_args()
    body = report(check(args.context, args.new))
    if not args.no_write:
        write_section("long-context-checks", body)
    print(body)


if __name__ == "__main__":
    main()
