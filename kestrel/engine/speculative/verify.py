"""The acceptance rule for drafts proposed deterministically (one token each, draft probability 1).

At position i the target's sampling distribution p_i is the one plain decoding would sample from after the
output so far plus the drafts before i (stop-token masking until min_tokens, penalties, temperature, min_p,
top_k, top_p). Draft d_i is accepted with probability p_i(d_i); the first rejected position draws from p_i with
d_i removed and renormalised (the residual max(0, p_i - q_i) for a one-hot q_i); when every draft is accepted, a
last token is drawn from p_k. Each emitted token then has exactly the distribution plain decoding gives it.
Greedy requests accept a draft exactly when it is the argmax, so their output equals plain greedy decoding.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingRow, apply_penalties, mask_stop_tokens, warp_logits


def verify(logits: torch.Tensor, draft: list[int], row: SamplingRow) -> list[int]:
    """logits [k+1, V] fp32: the target's at the last computed token and at each of the k draft tokens ->
    the tokens to emit (the accepted drafts, then one drawn from the target), 1 to k+1 of them."""
    params = row.params
    if params.greedy and not params.penalised and len(row.output_ids) >= params.min_tokens:
        best = logits[:len(draft) + 1].argmax(-1).tolist()     # nothing depends on the position: one argmax
        accepted = next((i for i, (token, guess) in enumerate(zip(best, draft)) if token != guess), len(draft))
        return best[:accepted + 1]
    emitted: list[int] = []
    for i in range(len(draft) + 1):
        step = SamplingRow(row.params, row.prompt_ids, [*row.output_ids, *emitted], row.generator,
                           row.eos_token_ids)
        work = apply_penalties(mask_stop_tokens(logits[i:i + 1], [step]), [step])
        guess = draft[i] if i < len(draft) else None
        if row.params.greedy:
            best = int(work[0].argmax())
            emitted.append(best)
            if best != guess:
                return emitted
            continue
        probs = warp_logits(work, [row.params]).softmax(dim=-1)[0]
        if guess is not None and _uniform(row.generator, probs.device) < probs[guess]:
            emitted.append(guess)
            continue
        if guess is not None:
            probs = probs.clone()
            probs[guess] = 0
        emitted.append(int(torch.multinomial(probs / probs.sum(), 1, generator=row.generator)))
        return emitted
    return emitted


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand(1, generator=generator, device=device))
