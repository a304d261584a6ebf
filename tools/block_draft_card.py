"""The block draft's model card: README.md rendered from its eval.json."""

from __future__ import annotations

from pathlib import Path


def write_card(report: dict, path: Path) -> None:
    path.write_text(render_card(report))


def _rows(entry: dict) -> str:
    ks = [key for key in entry if key.startswith("k=")]
    return "\n".join(f"| {key[2:]} | {entry[key]['acceptance_length']:.2f} | {entry[key]['steps']:,} |" for key in ks)


def render_card(r: dict) -> str:
    held, sample, train = r["held_out"], r["sample"], r["training"]
    recipe = train["recipe"]
    slots = ", ".join(f"{100 * x:.1f}%" for x in held["slot_top1"])
    return f"""# k3.1-tiny-dflash

A DFlash-style block draft for kestrel's bundled model, `models/k3.1-tiny`: {r['parameters'] / 1e6:.2f}M parameters
({r['size_bytes'] / 2**20:.1f} MiB in bfloat16) that propose a block of up to {recipe['block_size']} tokens in one forward, from
the target's hidden state at the last computed position and the token after it. Trained by
`tools/train_block_draft.py` on two shared CPU cores ({train['training_seconds'] / 60:.1f} minutes of optimizer steps, after
generating its data); served with

    kestrel serve --speculative-algorithm DFLASH --speculative-draft-model-path models/k3.1-tiny-dflash

## Architecture

`config.json` (`model_type: kestrel_block_draft`) and `model.safetensors`, read by
`kestrel.models.block_draft.load_block_draft`. The draft reads {recipe['block_size'] + 2} slots: the target's hidden state
h_t (RMSNorm, then a linear projection), the target's embedding of token t+1, and {recipe['block_size']} mask slots, plus a
learned embedding per slot; {recipe['num_layers']} pre-norm layers ({recipe['num_heads']} heads, bidirectional attention over the slots,
SwiGLU MLP of {recipe['intermediate_size']}); mask slot i, through the target's final norm and lm_head, predicts token t+1+i.
The target's embedding, final norm and lm_head are shared, not stored here. The drafter keeps no per-sequence
state, so rejected drafts and rolled-back sequences leave nothing behind.

## Data and recipe

{recipe['shards'] * recipe['shard_prompts']:,} prompts of {recipe['prompt_len']} tokens ([BOS], then text from a line start) drawn from the bundled model's
training works ({train['corpus']}; held-out works excluded), each continued greedily for {recipe['new_tokens']} tokens by
the frozen bundled model in float32, its hidden state kept at every position: {train['positions']:,} training
positions, each labelled with the target's own next {recipe['block_size']} greedy tokens (what verification compares against).
{recipe['steps']:,} steps of {recipe['batch_size']} positions, seed {recipe['seed']}; cross-entropy per slot weighted {recipe['slot_decay']}^i; AdamW (lr {recipe['lr']},
betas 0.9/0.95, weight decay {recipe['weight_decay']}, {recipe['warmup_steps']} warm-up steps, cosine decay to {recipe['final_lr_ratio']:.0%}),
gradient clipping at {recipe['grad_clip']}. Final training loss (mean of the last 100 steps) {train['final_loss']:.3f}.

## Acceptance length

Tokens emitted per verification (accepted drafts + the target's own token) under greedy verification against the
target's greedy tokens, replayed by `tools/block_draft_eval.py` with the shipped weights in float32.

Held-out works ({', '.join(held['works'])}): {held['prompts']} prompts spread over them, {held['new_tokens']} new tokens each.

| draft tokens k | acceptance length | verifications |
|---|---|---|
{_rows(held)}

Top-1 accuracy of each block slot against the target's greedy token there (all positions): {slots}.

On `{sample['file']}` ({sample['prompts']} prompts, {sample['new_tokens']} new tokens each), the sample that
`tests/models/test_block_draft.py` re-measures:

| draft tokens k | acceptance length | verifications |
|---|---|---|
{_rows(sample)}

All numbers live in `eval.json`, from which this card is generated.

## Limits

- Its only target is k3.1-tiny; it reads that model's hidden states and shares its embedding and lm_head.
- It sees one hidden state, not the context: what the target's last hidden state does not carry, it cannot draft.
- Trained on plain-text continuations only, not the chat format; acceptance on chat replies is not measured.
- The engine's verification computes hidden states in blocks, which round differently from the one-token steps
  measured here, so the engine's acceptance can differ slightly.
"""
