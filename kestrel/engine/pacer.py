"""How many prompt tokens a step may take while sequences decode (--max-decode-stall-ms).

A step computes its decoding sequences' next tokens together with its prompt chunks, so every running stream waits
for the whole step: a step that prefills a burst of prompts (clients that finished together and sent their next
requests at once, or a long prompt) holds them up for as long as the burst takes. While any sequence decodes, the
scheduler takes only the prompt tokens that keep the step within about `stall_s`, or, where the decoding sequences
alone take more than half of that, as many as take as long as they do (so prompts never crawl: on a slow path a
step at most doubles); the rest wait for later steps. A step with no decoding sequence takes prompt tokens up to
--max-prefill-tokens, as before.

A step's wall time is modelled as a + b * (decoding sequences) + c * (prompt tokens), fitted by least squares to the
last WINDOW steps with prompt tokens and the last WINDOW without. The bound depends on time, so which step a prompt
token lands in can change from run to run (as it does with requests' arrival times); with
--enable-deterministic-inference every token's result is the same whatever the batch.
"""

from __future__ import annotations

from collections import deque

import torch

MIN_PROMPT_TOKENS = 32
"""Prompt tokens a step may always take, however slow the model says it is: prompts keep moving."""
WINDOW = 32
"""Steps of each kind (with and without prompt tokens) the cost model is fitted to."""


class PrefillPacer:
    """The prompt tokens of a step while sequences decode, from a cost model of recent steps."""

    def __init__(self, stall_s: float):
        """stall_s: how long a decoding sequence should wait at most for a step (0: no bound)."""
        self.stall_s = stall_s
        self.prefills: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)   # (decoding, prompt tokens, seconds)
        self.decodes: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)

    def observe(self, decoding: int, prompt_tokens: int, seconds: float) -> None:
        """A step's wall time, its decoding sequences and the prompt tokens it computed."""
        (self.prefills if prompt_tokens else self.decodes).append((decoding, prompt_tokens, seconds))

    def limit(self, decoding: int) -> int | None:
        """Most prompt tokens in the next step, which decodes `decoding` sequences; None: no bound (disabled, or no
        step with prompt tokens measured yet)."""
        if not self.stall_s or not self.prefills:
            return None
        steps = torch.tensor([(1.0, d, p, s) for d, p, s in [*self.prefills, *self.decodes]], dtype=torch.float64)
        fit = torch.linalg.lstsq(steps[:, :3], steps[:, 3:], driver="gelsd")     # (SVD: rank-deficient too)
        fixed, per_sequence, per_token = fit.solution.flatten().tolist()
        if per_token <= 0:          # (noise, or prompt steps all alike: take the slowest prompt token seen)
            per_token = max(s / p for _, p, s in self.prefills)
        decode = max(fixed + per_sequence * decoding, 0.0)
        room = max(self.stall_s - decode, decode)       # prompts get at least as long as the decode tokens take
        return max(MIN_PROMPT_TOKENS, int(room / per_token))
