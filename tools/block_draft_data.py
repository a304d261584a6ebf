"""Data of the block draft: the target's greedy continuations of prompts, with its hidden state at every position.

A draft is verified against the target's own greedy tokens, so it learns from them: each prompt ([BOS] and the
text from the start of a line) is continued greedily by the frozen target (float32), and every position p from the
prompt's last token on gives one example: the hidden state h_p, the token y_{p+1}, and the tokens y_{p+2}, ...,
y_{p+1+block_size} to predict. Prompts depend only on the seed and the shard, so a resumed run regenerates nothing
it has and gets the same data.
"""

from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer

from corpus import Work
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.models.kimi import KimiForCausalLM
from tiny_data import tokenize_work
from tiny_tokenizer import BOS

IGNORE = -100
"""Target id of a block slot past the end of a continuation (no loss there)."""


@torch.inference_mode()
def greedy_with_hidden(model: KimiForCausalLM, prompts: torch.Tensor, new_tokens: int,
                       page_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts [n, L] int64 -> (tokens [n, L + new_tokens]: prompts and their greedy continuations, hidden
    [n, L + new_tokens - 1, D] fp32: the target's pre-final-norm hidden state at every position but the last)."""
    n, length = prompts.shape
    pages = -(-(length + new_tokens) // page_size)
    cache = HybridCache.allocate(model.config, num_slots=n, num_pages=n * pages, page_size=page_size,
                                 dtype=model.lm_head.weight.dtype)
    table, slots = torch.arange(n * pages).view(n, pages), list(range(n))
    hidden = model(prompts.reshape(-1), ForwardBatch.build([length] * n, None, slots, table, page_size), cache)
    states, tokens = [hidden.view(n, length, -1)], [prompts]
    for step in range(new_tokens):
        tokens.append(model.compute_logits(states[-1][:, -1]).argmax(-1, keepdim=True))
        if step == new_tokens - 1:
            break
        batch = ForwardBatch.build([1] * n, [length + step] * n, slots, table, page_size)
        states.append(model(tokens[-1].reshape(-1), batch, cache).view(n, 1, -1))
    return torch.cat(tokens, 1), torch.cat(states, 1).float()


def block_targets(tokens: torch.Tensor, start: int, block_size: int) -> torch.Tensor:
    """tokens [n, T] -> targets [n, T - 2 - start, block_size]: for each position p from `start` to T - 3, the
    tokens p+2 .. p+1+block_size (IGNORE past T - 1)."""
    n, total = tokens.shape
    padded = torch.cat([tokens, torch.full((n, block_size), IGNORE)], 1)
    offsets = torch.arange(start, total - 2).unsqueeze(1) + 2 + torch.arange(block_size)
    return padded[:, offsets]


class PromptSource:
    """Prompts of `length` tokens, [BOS] then the text of a work from the start of a line, drawn by a seeded RNG."""

    def __init__(self, works: list[Work], tokenizer: Tokenizer, length: int):
        self.bos, self.length = tokenizer.token_to_id(BOS), length
        self.works = [tokenize_work(w, tokenizer) for w in works]
        self.starts = [(i, int(o)) for i, w in enumerate(self.works) for o in w.line_starts
                       if o + length <= len(w.ids)]

    def random(self, count: int, seed: int) -> torch.Tensor:
        """[count, length] int64 prompts drawn by random.Random(seed)."""
        rng = random.Random(seed)
        return torch.stack([self._at(*self.starts[rng.randrange(len(self.starts))]) for _ in range(count)])

    def spread(self, count: int) -> torch.Tensor:
        """[count, length] int64 prompts at line starts spread evenly over the works (for evaluation)."""
        return torch.stack([self._at(*self.starts[i * len(self.starts) // count]) for i in range(count)])

    def _at(self, work: int, offset: int) -> torch.Tensor:
        body = self.works[work].ids[offset:offset + self.length - 1]
        return torch.cat([torch.tensor([self.bos]), body])
