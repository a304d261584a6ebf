"""Train the block draft of the bundled model (models/k3.1-tiny-dflash) on two CPU cores, and write its folder.

    .venv/bin/python tools/train_block_draft.py [--out models/k3.1-tiny-dflash] [--work .cache/train_block_draft]
                                                [--max-minutes 60]

1. Data (block_draft_data.py): prompts from the bundled model's training works, continued greedily by the frozen
   bundled model in float32, with its hidden state at every position; written in shards to --work.
2. Training: each example is a position p of a continuation (its hidden state and token p+1); the draft's block
   predicts tokens p+2 .. p+1+block_size, by cross-entropy weighted slot_decay^i at slot i (the first drafts
   decide most of the acceptance). AdamW, linear warm-up, cosine decay, gradient clipping; the target's embedding,
   final norm and lm_head are frozen and shared.
3. Export: the weights in bfloat16 beside the bundled model, eval.json (acceptance lengths on held-out text,
   block_draft_eval.py) and the model card.

A run stops, checkpointed, after --max-minutes of wall time (the machine is shared); rerunning resumes it. Batches
depend only on the seed and the step, so a resumed run trains exactly like an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from block_draft_card import write_card
from block_draft_data import IGNORE, PromptSource, block_targets, greedy_with_hidden
from block_draft_eval import measure
from corpus import PACKAGE, Corpus, Work, load_corpus
from kestrel.models.block_draft import BlockDraftConfig, BlockDraftModel, load_block_draft, save_block_draft
from kestrel.models.checkpoint import load_model
from kestrel.models.kimi import KimiForCausalLM

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "models" / "k3.1-tiny"
SAMPLE_FILE = "heldout_sample.txt"


@dataclass(frozen=True)
class Recipe:
    """Every setting of a run (stored in checkpoints and eval.json)."""

    seed: int = 0
    prompt_len: int = 32
    new_tokens: int = 64
    shard_prompts: int = 64
    shards: int = 192
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 384
    block_size: int = 6
    steps: int = 24000
    batch_size: int = 128
    lr: float = 2e-3
    final_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    slot_decay: float = 0.8
    log_every: int = 25
    checkpoint_every: int = 100
    eval_prompts: int = 24
    sample_prompts: int = 8
    sample_new_tokens: int = 40

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - 1 - self.warmup_steps)
        return self.lr * (self.final_lr_ratio + (1 - self.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def draft_config(self, hidden_size: int) -> BlockDraftConfig:
        return BlockDraftConfig(hidden_size, self.num_layers, self.num_heads, self.intermediate_size, self.block_size,
                                target="k3.1-tiny")


class OutOfTime(Exception):
    """The run's --max-minutes are spent; everything so far is saved."""


class Deadline:
    def __init__(self, minutes: float):
        self.end = time.monotonic() + 60 * minutes

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise OutOfTime


@dataclass
class Examples:
    """Training examples: hidden states [E, D] fp32, next ids [E], block targets [E, block_size] (IGNORE: none)."""

    hidden: torch.Tensor
    next_ids: torch.Tensor
    targets: torch.Tensor


def generate_shards(target: KimiForCausalLM, source: PromptSource, recipe: Recipe, work: Path,
                    deadline: Deadline) -> Examples:
    """Every shard's examples, generating the shards not yet in work/shards."""
    folder = work / "shards"
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    for shard in range(recipe.shards):
        path = folder / f"{shard:04d}.pt"
        if not path.is_file():
            deadline.check()
            began = time.perf_counter()
            prompts = source.random(recipe.shard_prompts, recipe.seed * 1_000_003 + shard)
            tokens, hidden = greedy_with_hidden(target, prompts, recipe.new_tokens)
            torch.save({"tokens": tokens, "hidden": hidden}, path.with_suffix(".partial"))
            path.with_suffix(".partial").replace(path)
            print(f"shard {shard + 1}/{recipe.shards}: {tokens.numel() - prompts.numel()} greedy tokens in "
                  f"{time.perf_counter() - began:.1f}s", flush=True)
        parts.append(examples_of(torch.load(path), recipe))
    return Examples(*(torch.cat(x) for x in zip(*((p.hidden, p.next_ids, p.targets) for p in parts))))


def examples_of(shard: dict, recipe: Recipe) -> Examples:
    """A shard's examples: positions from the prompt's last token to the third-last token of each continuation."""
    tokens, hidden, start = shard["tokens"], shard["hidden"], recipe.prompt_len - 1
    end = tokens.shape[1] - 2
    return Examples(hidden[:, start:end].reshape(-1, hidden.shape[-1]), tokens[:, start + 1:end + 1].reshape(-1),
                    block_targets(tokens, start, recipe.block_size).reshape(-1, recipe.block_size))


def block_loss(target: KimiForCausalLM, draft: BlockDraftModel, batch: Examples, weights: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted cross-entropy over the block's slots, per-slot top-1 accuracy [block_size])."""
    out = draft(batch.hidden, target.model.embed_tokens(batch.next_ids))
    logits = target.compute_logits(out.reshape(-1, out.shape[-1])).view(*batch.targets.shape, -1)
    ce = F.cross_entropy(logits.transpose(1, 2), batch.targets, ignore_index=IGNORE, reduction="none")
    valid = batch.targets != IGNORE
    per_slot = (ce * valid).sum(0) / valid.sum(0).clamp_min(1)
    hits = ((logits.argmax(-1) == batch.targets) & valid).sum(0) / valid.sum(0).clamp_min(1)
    return (per_slot * weights).sum() / weights.sum(), hits


def train(recipe: Recipe, out: Path, work: Path, minutes: float) -> None:
    deadline = Deadline(minutes)
    torch.manual_seed(recipe.seed)
    target = load_model(TARGET, dtype=torch.float32).requires_grad_(False)
    tokenizer = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    corpus = load_corpus(ROOT / ".cache" / "corpus")
    data = generate_shards(target, PromptSource(corpus.train, tokenizer, recipe.prompt_len), recipe, work, deadline)
    print(f"{len(data.next_ids):,} training positions", flush=True)
    draft = BlockDraftModel(recipe.draft_config(target.config.hidden_size)).init_weights(recipe.seed)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=recipe.lr, betas=(0.9, 0.95),
                                  weight_decay=recipe.weight_decay)
    start, clock = resume(draft, optimizer, recipe, work)
    weights = recipe.slot_decay ** torch.arange(recipe.block_size, dtype=torch.float32)
    log = work / "log.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    log.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] < start))
    step = start
    try:
        for step in range(start, recipe.steps):
            deadline.check()
            began = time.perf_counter()
            rows = torch.randint(len(data.next_ids), (recipe.batch_size,),
                                 generator=torch.Generator().manual_seed(recipe.seed * 1_000_003 + step))
            loss, hits = block_loss(target, draft, Examples(data.hidden[rows], data.next_ids[rows],
                                                            data.targets[rows]), weights)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), recipe.grad_clip)
            for group in optimizer.param_groups:
                group["lr"] = recipe.lr_at(step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            clock += time.perf_counter() - began
            with log.open("a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item(), "slot_top1": hits.tolist(),
                                    "wall_s": clock}) + "\n")
            if (step + 1) % recipe.log_every == 0:
                print(f"step {step + 1}/{recipe.steps} loss {loss.item():.3f} top-1 of slots 1-3 "
                      f"{', '.join(f'{h:.2f}' for h in hits[:3].tolist())} ({clock / 60:.1f} min)", flush=True)
            if (step + 1) % recipe.checkpoint_every == 0 or step + 1 == recipe.steps:
                save_checkpoint(draft, optimizer, recipe, work, step + 1, clock)
    except OutOfTime:
        save_checkpoint(draft, optimizer, recipe, work, step, clock)
        raise
    export(target, draft, tokenizer, corpus, recipe, clock, len(data.next_ids), final_loss(log), out)


def export(target: KimiForCausalLM, draft: BlockDraftModel, tokenizer: Tokenizer, corpus: Corpus, recipe: Recipe,
           clock: float, positions: int, loss: float, out: Path) -> None:
    """Write the draft (bfloat16), then measure the shipped weights (loaded in float32) for eval.json and the card."""
    save_block_draft(draft, out)
    shipped = load_block_draft(out, torch.float32)
    ks = tuple(k for k in (1, 2, 4, recipe.block_size) if k <= recipe.block_size)
    held_out = PromptSource(corpus.held_out, tokenizer, recipe.prompt_len).spread(recipe.eval_prompts)
    sample = PromptSource([Work("sample", (TARGET / SAMPLE_FILE).read_text(encoding="utf-8"))], tokenizer,
                          recipe.prompt_len).spread(recipe.sample_prompts)
    report = {
        "protocol": {"dtype": "float32", "prompt_len": recipe.prompt_len, "note": "see tools/block_draft_eval.py"},
        "held_out": {"works": [w.name for w in corpus.held_out], "prompts": recipe.eval_prompts,
                     "new_tokens": recipe.new_tokens,
                     **measure(target, shipped, held_out, recipe.new_tokens, ks)},
        "sample": {"file": f"../k3.1-tiny/{SAMPLE_FILE}", "prompts": recipe.sample_prompts,
                   "new_tokens": recipe.sample_new_tokens,
                   **measure(target, shipped, sample, recipe.sample_new_tokens, ks)},
        "parameters": sum(p.numel() for p in shipped.parameters()),
        "size_bytes": (out / "model.safetensors").stat().st_size,
        "training": {"training_seconds": clock, "positions": positions, "recipe": asdict(recipe),
                     "corpus": PACKAGE, "final_loss": loss},
    }
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    write_card(report, out / "README.md")
    print(json.dumps({k: report[k] for k in ("held_out", "sample")}, indent=1))


def final_loss(log: Path, last: int = 100) -> float:
    """Mean training loss of the last `last` steps in the log."""
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()][-last:]
    return sum(losses) / len(losses)


def resume(draft: BlockDraftModel, optimizer: torch.optim.Optimizer, recipe: Recipe, work: Path) -> tuple[int, float]:
    """(first step to run, training wall seconds so far) after loading work/checkpoint.pt if there is one."""
    path = work / "checkpoint.pt"
    if not path.is_file():
        return 0, 0.0
    state = torch.load(path, weights_only=False)
    if state["recipe"] != asdict(recipe):
        raise SystemExit(f"{path} was written by a different recipe; move it away to start afresh.")
    draft.load_state_dict(state["draft"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["clock"]


def save_checkpoint(draft: BlockDraftModel, optimizer: torch.optim.Optimizer, recipe: Recipe, work: Path, step: int,
                    clock: float) -> None:
    partial = work / "checkpoint.pt.partial"
    torch.save({"recipe": asdict(recipe), "step": step, "clock": clock, "draft": draft.state_dict(),
                "optimizer": optimizer.state_dict()}, partial)
    partial.replace(work / "checkpoint.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "k3.1-tiny-dflash", help="folder to write")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "train_block_draft",
                        help="data shards, checkpoints and the loss log")
    parser.add_argument("--max-minutes", type=float, default=60.0, help="wall time of this run before it stops")
    parser.add_argument("--steps", type=int, default=Recipe.steps, help="training steps")
    parser.add_argument("--shards", type=int, default=Recipe.shards, help="data shards (of 64 prompts)")
    args = parser.parse_args()
    try:
        train(Recipe(steps=args.steps, shards=args.shards), args.out, args.work, args.max_minutes)
    except OutOfTime:
        raise SystemExit(f"stopped after {args.max_minutes:g} minutes, everything so far saved in {args.work}; "
                         "rerun to resume, or pass a larger --max-minutes.")


if __name__ == "__main__":
    main()
