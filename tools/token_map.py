"""Write a token map for --speculative-token-map (FR-Spec; kestrel.engine.speculative.token_map) for the bundled model: the
tokens its own greedy continuations use most.

    .venv/bin/python tools/token_map.py [--size 1024] [--out models/k3.1-tiny/token_map.pt]

Drafts can only be tokens of the map, and verification compares them with the target's greedy tokens, so the map
holds what the target writes: the most frequent tokens of its greedy continuations (float32) of seeded prompts from
its training works (block_draft_data.PromptSource, the block draft's own recipe), ties broken by the lower id. The
file is a torch-saved 1-D int64 tensor of ascending ids, SGLang's format. The script prints the share of the
target's greedy tokens on the held-out works that the map holds (a draft outside the map is never proposed).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer

from block_draft_data import PromptSource, greedy_with_hidden
from corpus import load_corpus
from kestrel.models.checkpoint import load_model
from kestrel.models.kimi import KimiForCausalLM

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "models" / "k3.1-tiny"
PROMPT_LEN, NEW_TOKENS, BATCH = 32, 64, 64
SEED = 1


def greedy_counts(model: KimiForCausalLM, prompts: torch.Tensor) -> torch.Tensor:
    """[vocab] int64: how often each token appears in the greedy continuations of prompts [n, PROMPT_LEN]."""
    counts = torch.zeros(model.config.vocab_size, dtype=torch.long)
    for batch in prompts.split(BATCH):
        tokens, _ = greedy_with_hidden(model, batch, NEW_TOKENS)
        counts += torch.bincount(tokens[:, PROMPT_LEN:].flatten(), minlength=counts.numel())
    return counts


def hot_ids(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ascending ids of the `size` most frequent tokens [size] int64 (ties: the lower id first)."""
    order = torch.argsort(-counts, stable=True)
    return order[:size].sort().values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="tokens in the map")
    parser.add_argument("--prompts", type=int, default=4096, help="training prompts continued to count tokens")
    parser.add_argument("--out", type=Path, default=TARGET / "token_map.pt", help="file to write")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load_model(TARGET, torch.float32).requires_grad_(False)
    if not 1 <= args.size <= model.config.vocab_size:
        raise SystemExit(f"--size must be in 1..{model.config.vocab_size}.")
    tokenizer = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    corpus = load_corpus(ROOT / ".cache" / "corpus")
    counts = greedy_counts(model, PromptSource(corpus.train, tokenizer, PROMPT_LEN).random(args.prompts, SEED))
    ids = hot_ids(counts, args.size)
    torch.save(ids, args.out)
    held = greedy_counts(model, PromptSource(corpus.held_out, tokenizer, PROMPT_LEN).spread(256))
    print(f"{args.out}: {args.size} tokens ({int((counts > 0).sum())} distinct in {int(counts.sum()):,} greedy "
          f"tokens of {args.prompts} training prompts); they hold {held[ids].sum() / held.sum():.2%} of the "
          f"target's {int(held.sum()):,} greedy tokens on 256 held-out prompts")


if __name__ == "__main__":
    main()
