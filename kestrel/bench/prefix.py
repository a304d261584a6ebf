"""Prefix caching in a run: the server's hit rate (from /metrics, after minus before) next to the most a prefix
cache could have served for the prompts the run sent.

The theoretical maximum is counted on token ids, the unit the server counts in: every prompt sent (warm-up
included) is tokenized by the server's /tokenize exactly as the server renders it, and in dispatch order each
prompt can reuse its longest common prefix with any earlier prompt, but never its last token (whose logits must be
computed). Earlier requests' generated tokens are not counted: no workload here puts a model's output into a later
prompt (agentic replies are pre-canned), so only prompts are shared. Requests of earlier runs on the same server
are not counted either: a server that kept their prefixes can exceed this maximum.
"""

from __future__ import annotations

import re

import httpx

from .client import ServerError

QUERIED, HIT = "kestrel_prefix_cache_queried_tokens", "kestrel_prefix_cache_hit_tokens"


def theoretical_hits(prompts: list[list[int]]) -> tuple[int, int]:
    """(prompt tokens, cacheable tokens) of prompts sent in this order: each prompt's longest common prefix with
    an earlier one, at most all but its last token."""
    trie: dict = {}
    total = cacheable = 0
    for ids in prompts:
        node, shared = trie, 0
        for token in ids:
            if token not in node:
                break
            node, shared = node[token], shared + 1
        total += len(ids)
        cacheable += min(shared, len(ids) - 1)
        node = trie
        for token in ids:
            node = node.setdefault(token, {})
    return total, cacheable


def tokenize_bodies(base_url: str, bodies: list[dict], api_key: str | None = None) -> list[list[int]]:
    """Each request body's prompt as token ids: id lists as they are, text and chat messages by /tokenize."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = []
    with httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=60) as http:
        for body in bodies:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                out.append(prompt)
                continue
            request = {"messages": body["messages"]} if "messages" in body else {"prompt": prompt}
            try:
                response = http.post("/tokenize", json=request)
            except httpx.HTTPError as e:
                raise ServerError(f"cannot reach {base_url}/tokenize ({type(e).__name__}).") from e
            if response.status_code != 200:
                raise ServerError(f"{base_url}/tokenize answered {response.status_code}.")
            out.append(response.json()["tokens"])
    return out


def metric(text: str | None, name: str) -> float | None:
    """An unlabelled sample's value in Prometheus text, or None."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", text or "", re.M)
    return float(found.group(1)) if found else None


def prefix_cache_report(before_metrics: str | None, after_metrics: str | None, prompts: list[list[int]] | None,
                        tokenize_error: str | None = None) -> dict:
    """The server's hit tokens over queried tokens during the run (None when its /metrics has no prefix-cache
    gauges), and the theoretical maximum of the prompts sent (None, with the reason, when they could not be
    tokenized)."""
    values = [metric(t, n) for t in (before_metrics, after_metrics) for n in (QUERIED, HIT)]
    server = None
    if None not in values:
        queried, hit = values[2] - values[0], values[3] - values[1]
        server = {"queried_tokens": int(queried), "hit_tokens": int(hit),
                  "hit_rate": hit / queried if queried else None}
    theoretical = {"unavailable": tokenize_error}
    if prompts is not None:
        total, cacheable = theoretical_hits(prompts)
        theoretical = {"prompt_tokens": total, "cacheable_tokens": cacheable,
                       "max_hit_rate": cacheable / total if total else None}
    return {"server": server, "theoretical": theoretical}
