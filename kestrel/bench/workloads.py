"""Request workloads: `random` (token-exact lengths), `file` (JSONL prompts) and `agentic` (sessions shaped like
SemiAnalysis's AgentX; see agentic.py). Every workload is deterministic from its seed."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import httpx

from .client import RequestSpec, ServerError

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there all one their we him been has when who will more no if out so said what up "
         "its about into than them can only other new some could time these two may then do first any my now such "
         "like our over man me even most made after also did many before must through back years where much your "
         "way well down should because each just those people how too little state good very make world still own "
         "see men work long get here between both life being under never day same another know while last might "
         "us great old year off come since against go came right used take three").split()


def filler_text(rng: random.Random, words: int) -> str:
    """Pseudo-English text of about `words` words."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass(frozen=True)
class RandomWorkload:
    """Completions with token-exact prompt lengths (taken from tokenized filler text via the server's /tokenize)
    and fixed output lengths (ignore_eos), each drawn uniformly from [L(1-r), L(1+r)] as vLLM's random dataset."""

    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    seed: int = 0

    def requests(self, count: int, base_url: str, api_key: str | None = None) -> list[RequestSpec]:
        rng = random.Random(self.seed)
        lengths = [(self._draw(rng, self.input_len), self._draw(rng, self.output_len)) for _ in range(count)]
        pool = _tokenize(base_url, api_key, filler_text(rng, 2 * max(n for n, _ in lengths) + 64))
        specs = []
        for n, out in lengths:
            if n > len(pool):
                raise ServerError(f"could not make a {n}-token prompt from the server's tokenizer.")
            start = rng.randrange(0, len(pool) - n + 1)
            specs.append(RequestSpec("completions", {"prompt": pool[start:start + n], "max_tokens": out,
                                                     "ignore_eos": True, "temperature": 0}, prompt_tokens=n))
        return specs

    def _draw(self, rng: random.Random, length: int) -> int:
        low, high = max(1, int(length * (1 - self.range_ratio))), max(1, int(length * (1 + self.range_ratio)))
        return rng.randint(low, high)


def _tokenize(base_url: str, api_key: str | None, text: str) -> list[int]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.post(base_url.rstrip("/") + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                              headers=headers, timeout=60)
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach {base_url}/tokenize ({type(e).__name__}).") from e
    if response.status_code != 200:
        raise ServerError(f"{base_url}/tokenize answered {response.status_code}; the random workload needs it "
                          "to make token-exact prompts.")
    return response.json()["tokens"]


@dataclass(frozen=True)
class FileWorkload:
    """Prompts from a JSONL file: {"prompt": text or ids} (completions) or {"messages": [...]} (chat), each
    optionally with "max_tokens" (default output_len)."""

    path: Path
    output_len: int = 128

    def requests(self, count: int | None = None) -> list[RequestSpec]:
        try:
            rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.path} is not a readable JSONL file ({e}).") from e
        specs = []
        for i, row in enumerate(rows[:count] if count else rows):
            if not isinstance(row, dict) or not ({"prompt", "messages"} & set(row)):
                raise ValueError(f'line {i + 1} of {self.path} has neither "prompt" nor "messages".')
            endpoint = "chat" if "messages" in row else "completions"
            body = {"messages" if endpoint == "chat" else "prompt": row.get("messages", row.get("prompt")),
                    "max_tokens": row.get("max_tokens", self.output_len), "ignore_eos": True, "temperature": 0}
            specs.append(RequestSpec(endpoint, body))
        return specs
