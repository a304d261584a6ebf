"""Synthetic agent sessions with the statistical shape of SemiAnalysis's AgentX (shared/reference/workloads.md).

A session is a main chain of chat turns over one growing message array: a long system prompt with tool
definitions, a user task, then per turn the assistant's (pre-canned) reply with its reasoning and a tool result,
so every request's prompt extends the previous one. In a share of sessions, sub-agents fork from the parent's
context (its messages so far plus a sub-task), run their own chains, and the parent's next turn waits for them
(join) and reads their results. Think time separates turns. AgentX's published shape, and how it is scaled here:

| AgentX (full corpus)                       | here (defaults)                                    |
| median 43 main turns, heavy tail            | lognormal turns, median `turns_median` (6)          |
| input median 142k tokens, p90 317k          | divided by `length_scale` (256): median ~550 words  |
| output median 444 tokens                    | divided by `output_scale` (16): median ~28 tokens   |
| 44% of sessions have sub-agents, median 4   | `subagent_share` 0.44, groups ~ 1 + Poisson(1)      |
| think time: plotted, not published          | lognormal, median `think_median` s, capped at 10 s  |

Lengths are counted in filler words (about one token each). Everything is deterministic from the seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from .workloads import filler_text

AGENTX_INPUT_MEDIAN, AGENTX_OUTPUT_MEDIAN, THINK_CAP_S = 142_016, 444, 10.0


@dataclass(frozen=True)
class AgenticShape:
    sessions: int = 16
    turns_median: int = 6
    length_scale: float = 256.0
    output_scale: float = 16.0
    system_words: int = 300
    subagent_share: float = 0.44
    think_median: float = 1.0
    max_context: int = 4096
    seed: int = 0


@dataclass
class Turn:
    """One request: the whole message array so far, its output length and the think time before it.

    extends_previous: the prompt extends the previous turn's whole prompt (generation prompt included).
    shared_with_parent: for a sub-agent's first turn, how many leading messages it shares with its parent.
    """

    messages: list[dict]
    max_tokens: int
    think_before: float
    extends_previous: bool = True
    shared_with_parent: int = 0
    spawn: list[Chain] = field(default_factory=list)

    @property
    def words(self) -> int:
        return sum(len((m.get("content") or "").split()) + len((m.get("reasoning_content") or "").split())
                   for m in self.messages)


@dataclass
class Chain:
    role: str                        # "main" or "subagent"
    turns: list[Turn]


@dataclass
class Session:
    id: str
    main: Chain


def sessions(shape: AgenticShape) -> list[Session]:
    rng = random.Random(shape.seed)
    return [_session(rng, shape, i) for i in range(shape.sessions)]


def _lognormal(rng: random.Random, median: float, sigma: float = 0.8) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def _session(rng: random.Random, shape: AgenticShape, index: int) -> Session:
    marker = f"[session {shape.seed}-{index}]"        # like AgentX's per-play marker: no sharing across sessions
    system = {"role": "system", "content": f"{marker} You are a coding agent. Tools: read_file(path), "
                                           f"run(command), search(query). {filler_text(rng, shape.system_words)}"}
    messages = [system, {"role": "user", "content": f"Task: {filler_text(rng, 12)}"}]
    turns = max(2, round(_lognormal(rng, shape.turns_median)))
    main = _chain(rng, shape, "main", messages, turns)
    if rng.random() < shape.subagent_share and len(main.turns) > 2:
        # in order along the session, so that joining one group's results never rewrites an earlier fork's context
        for at in sorted(rng.randrange(0, len(main.turns) - 1) for _ in range(1 + _poisson(rng, 1.0))):
            _spawn_group(rng, shape, main, at)
    return Session(f"session-{shape.seed}-{index}", main)


def _chain(rng: random.Random, shape: AgenticShape, role: str, messages: list[dict], turns: int) -> Chain:
    """A chain of turns over one growing message array, stopping before it would pass the context."""
    out_median = AGENTX_OUTPUT_MEDIAN / shape.output_scale
    input_median = AGENTX_INPUT_MEDIAN / shape.length_scale
    growth = max(8.0, (input_median - shape.system_words) / max(1.0, turns / 2) - out_median)
    chain = Chain(role, [])
    messages = list(messages)
    for k in range(turns):
        out = max(2, round(_lognormal(rng, out_median)))
        turn = Turn(list(messages), out, 0.0 if k == 0 else min(THINK_CAP_S, _lognormal(rng, shape.think_median, 1.0)))
        if turn.words + out > shape.max_context * 0.8:
            break
        chain.turns.append(turn)
        reasoning = max(1, out // 3)
        messages += [{"role": "assistant", "reasoning_content": filler_text(rng, reasoning),
                      "content": filler_text(rng, max(1, out - reasoning))},
                     {"role": "user", "content": f"Tool result: {filler_text(rng, round(_lognormal(rng, growth)))}"}]
    return chain


def _spawn_group(rng: random.Random, shape: AgenticShape, main: Chain, at: int) -> None:
    """Sub-agents fork after parent turn `at` (not the last); the next parent turn joins them and reads results."""
    parent, after = main.turns[at], main.turns[at + 1]
    base = [*parent.messages, *after.messages[len(parent.messages):len(parent.messages) + 1]]   # + parent's reply
    group = []
    for _ in range(rng.randint(1, 3)):
        task = {"role": "user", "content": f"Sub-task: {filler_text(rng, 10)}"}
        chain = _chain(rng, shape, "subagent", [*base, task], rng.randint(1, 4))
        if chain.turns:
            chain.turns[0].extends_previous = False
            chain.turns[0].shared_with_parent = len(base)
            group.append(chain)
    parent.spawn += group
    results = [{"role": "tool", "tool_call_id": f"subagent-{at}-{i}",        # OpenAI requires it (SGLang's router too)
                "content": f"Sub-agent result: {filler_text(rng, 15)}"} for i in range(len(group))]
    _insert_after(main, at + 1, len(base), results)


def _insert_after(main: Chain, first: int, position: int, extra: list[dict]) -> None:
    """Put the joined results into every later parent turn's messages at `position` (they stay prefixes)."""
    for turn in main.turns[first:]:
        turn.messages[position:position] = [dict(m) for m in extra]


def _poisson(rng: random.Random, mean: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-mean)
    while True:
        p *= rng.random()
        if p < limit:
            return k
        k += 1


def describe(all_sessions: list[Session]) -> dict:
    """The generated corpus' shape, to compare with the published one."""
    turns = [t for s in all_sessions for t in _all_turns(s.main)]
    main_turns = sorted(len(s.main.turns) for s in all_sessions)
    words = sorted(t.words for t in turns)
    outs = sorted(t.max_tokens for t in turns)
    with_sub = sum(any(t.spawn for t in s.main.turns) for s in all_sessions)
    return {"sessions": len(all_sessions), "requests": len(turns),
            "median_main_turns": main_turns[len(main_turns) // 2],
            "median_input_words": words[len(words) // 2], "p90_input_words": words[int(0.9 * (len(words) - 1))],
            "median_output_tokens": outs[len(outs) // 2],
            "sessions_with_subagents": with_sub,
            "subagent_requests": sum(1 for s in all_sessions for t in s.main.turns for c in t.spawn for _ in c.turns)}


def _all_turns(chain: Chain) -> list[Turn]:
    return [x for t in chain.turns for x in [t, *(u for c in t.spawn for u in _all_turns(c))]]
