"""Writes the bundled model's folder from a trained model: the MXFP4 checkpoint (bf16 elsewhere) in the K3.1
schema, the tokenizer files, a held-out text sample, eval.json (every number of the model card), the loss curve
and the model card itself."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from corpus import HELD_OUT, PACKAGE, Corpus
from kestrel.config import parse_config
from kestrel.engine.llm import LLM
from kestrel.engine.sampling import SamplingParams
from kestrel.models.checkpoint import build_model, load_model, save_model
from kestrel.models.inspect import inspect_config
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.quantize import quantize_experts
from tiny_card import plot_loss, write_card
from tiny_config import INDEX_TOPK, MAX_POSITIONS, SEQ_LEN, tiny_config
from tiny_data import eval_windows
from tiny_eval import evaluate
from tiny_tokenizer import special_ids, write_tokenizer

SAMPLE_FILE = "heldout_sample.txt"
SAMPLE_WORK, SAMPLE_FROM, SAMPLE_CHARS = "macbeth", "ACT I.", 6000
PROMPTS = ["ROMEO.\nBut soft, what light", "KING.\nWhat news from France?\n\nMESSENGER.\n", "To be, or not to be"]


def sample_text(corpus: Corpus) -> str:
    """The opening of Macbeth's first act (held out), cut at a paragraph break after about SAMPLE_CHARS."""
    text = next(w.text for w in corpus.held_out if w.name == SAMPLE_WORK)
    body = text[text.index(SAMPLE_FROM):]
    return body[:body.rindex("\n\n", 0, SAMPLE_CHARS)].strip() + "\n"


def export(model: KimiForCausalLM, tokenizer: Tokenizer, corpus: Corpus, recipe: dict, stats: dict,
           held_out: list[torch.Tensor], log_path: Path, out: Path) -> None:
    """Quantize `model`'s routed experts, write the folder `out`, and measure what the card states."""
    out.mkdir(parents=True, exist_ok=True)
    unquantized = evaluate(model, held_out)
    quantized = quantize_experts(model)
    mxfp4 = evaluate(quantized, held_out)
    config_json = tiny_config(special_ids(tokenizer), mxfp4=True)
    shipped = build_model(parse_config(config_json), torch.bfloat16)
    shipped.load_state_dict(quantized.state_dict())
    save_model(shipped, out, config_json=config_json)
    write_tokenizer(tokenizer, out, MAX_POSITIONS)
    sample = sample_text(corpus)
    (out / SAMPLE_FILE).write_text(sample, encoding="utf-8")
    loaded = load_model(out, dtype=torch.float32)
    report = {
        "protocol": {"seq_len": SEQ_LEN, "dtype": "float32", "batch_size": 16,
                     "note": "windows of seq_len tokens after [BOS]; indexer top-k active; see tools/tiny_eval.py"},
        "sample": {"file": SAMPLE_FILE, "source": f"Macbeth, from the start of Act I (held out), {PACKAGE}",
                   **evaluate(loaded, eval_windows(sample, tokenizer, SEQ_LEN))},
        "held_out": {"works": list(HELD_OUT), "share_of_corpus": corpus.share_held_out(),
                     "unquantized_fp32": unquantized, "mxfp4_fp32": mxfp4, "shipped": evaluate(loaded, held_out)},
        "architecture": {"index_topk": INDEX_TOPK, "seq_len": SEQ_LEN, "max_positions": MAX_POSITIONS},
        "parameters": inspect_config(loaded.config).as_dict(),
        "size_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        "training": {**stats, "recipe": recipe, "corpus": PACKAGE,
                     "train_works": [w.name for w in corpus.train]},
        "samples": generations(out),
    }
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_loss(log_path, out / "loss_curve.png")
    write_card(report, out / "README.md")


def generations(folder: Path) -> list[dict]:
    """Greedy and sampled continuations of PROMPTS by the shipped model through kestrel's engine."""
    llm = LLM(str(folder), dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=60, seed=1)
    return [{"prompt": p, "greedy": llm.generate(p, greedy)[0].outputs[0].text,
             "sampled": llm.generate(p, sampled)[0].outputs[0].text} for p in PROMPTS]
