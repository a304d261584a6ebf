"""The block draft shipped beside the bundled model (models/k3.1-tiny-dflash): its folder round-trips, the
engine's BlockDrafter proposes exactly the draft model's argmax, and its model card's acceptance lengths hold when
tools/block_draft_eval.py re-measures them on the held-out sample."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from kestrel.distributed.parallel import SINGLE
from kestrel.engine.speculative.block import BlockDrafter
from kestrel.engine.speculative.mtp import DraftInput
from kestrel.engine.speculative.token_map import HotHead
from kestrel.models.block_draft import (BlockDraftConfig, BlockDraftModel, block_logits, load_block_draft,
                                        save_block_draft)
from kestrel.models.checkpoint import load_model

ROOT = Path(__file__).resolve().parents[2]
TARGET, DRAFT = ROOT / "models" / "k3.1-tiny", ROOT / "models" / "k3.1-tiny-dflash"
CARD = json.loads((DRAFT / "eval.json").read_text())


@pytest.fixture(scope="module")
def target():
    return load_model(TARGET, dtype=torch.float32)


@pytest.fixture(scope="module")
def draft():
    return load_block_draft(DRAFT, torch.float32)


def test_save_and_load_round_trip(tmp_path):
    model = BlockDraftModel(BlockDraftConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48,
                                             block_size=3)).init_weights(seed=1)
    save_block_draft(model, tmp_path)
    loaded = load_block_draft(tmp_path)
    assert loaded.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16).float()), name
    hidden, embeds = torch.randn(2, 32), torch.randn(2, 32)
    assert loaded(hidden, embeds).shape == (2, 3, 32)
    (tmp_path / "config.json").write_text(json.dumps({**model.config.to_json(), "block_size": 4}))
    with pytest.raises(ValueError, match="does not hold the tensors"):
        load_block_draft(tmp_path)


@pytest.mark.parametrize("compile", [None, "aot_eager"])
@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("min_confidence", [0.0, 0.5])
def test_drafts_are_the_draft_models_argmax_on_the_same_conditioning(target, draft, compile, mapped,
                                                                     min_confidence):
    """Each input's drafts: the draft model run alone on its last hidden state and next token, argmax, the first
    `count` of the block; inputs that want none get none. Also compiled (aot_eager: the graph inductor compiles),
    where 3 drafting rows are padded to a batch of 4; with a token map (512 random ids), the argmax among its
    tokens; and with min_confidence, every block only up to the first slot at which the product of the draft's
    softmax probabilities (among the map's tokens with one), averaged over the drafting inputs, falls below it."""
    gen = torch.Generator().manual_seed(0)
    size = draft.config.block_size
    kept = [torch.randn(9, 192, generator=gen) * 2, torch.randn(6, 192, generator=gen) * 2]    # two forwards
    inputs = [DraftInput(slot=i, start=5, forward=forward, first_row=first, capacity=64, count=count,
                         next_ids=torch.randint(4000, (m,), generator=gen).tolist())
              for i, (forward, first, m, count) in enumerate([(0, 0, 1, 4), (0, 1, 3, 0), (1, 0, 5, size + 3),
                                                              (0, 7, 2, 1)])]
    vocab = target.config.vocab_size
    ids = torch.randperm(vocab, generator=gen)[:512].sort().values
    outside = torch.full((vocab,), float("-inf") if mapped else 0.0)
    outside[ids] = 0

    def expected(inputs: list[DraftInput]) -> tuple[list[list[int]], bool]:
        """The rule above, computed on its own, and whether the token map changed a kept draft."""
        logits = {}
        for i, x in enumerate(inputs):
            last = kept[x.forward][x.first_row + len(x.next_ids) - 1]
            with torch.no_grad():
                logits[i] = block_logits(target, draft, last[None], torch.tensor(x.next_ids[-1:]))[0] + outside
        drafting = [torch.softmax(logits[i].double(), -1).max(-1).values.cumprod(0)
                    for i, x in enumerate(inputs) if x.count]
        average = torch.stack(drafting).mean(0).tolist()
        length = next((j for j, p in enumerate(average) if p < min_confidence), size)
        drafts = [logits[i].argmax(-1).tolist()[:min(x.count, length)] for i, x in enumerate(inputs)]
        changed = any(d != (logits[i] - outside).argmax(-1).tolist()[:len(d)] for i, d in enumerate(drafts))
        return drafts, changed

    drafter = BlockDrafter(target, draft, size, compile, HotHead(target.lm_head.weight, ids, vocab, SINGLE)
                           if mapped else None, min_confidence)
    drafts = drafter.draft(inputs, kept)
    want, changed = expected(inputs)
    assert drafts == want
    assert changed == (mapped and not min_confidence)     # (the map changes only drafts the cut drops here)
    assert ([len(d) for d in drafts] == [4, 0, size, 1]) == (min_confidence == 0)    # the cut shortens blocks
    few = [inputs[0], inputs[3]]                   # at most 4 drafts wanted: eagerly only 4 slots reach the lm_head
    assert drafter.draft(few, kept) == expected(few)[0]
    assert (drafter.compiled is not None) == bool(compile)            # it did not fall back to eager drafting


def test_compiled_drafters_with_and_without_a_token_map_share_no_graph(target, draft):
    """Compiled graphs skip guards on modules: a drafter without a token map, compiled after one with a map (same
    code, same shapes), must not run the mapped graph (it failed on the missing head and drafted eagerly)."""
    gen = torch.Generator().manual_seed(2)
    kept = [torch.randn(3, 192, generator=gen) * 2]
    inputs = [DraftInput(slot=i, start=5, forward=0, first_row=i, capacity=64, count=4, next_ids=[100 + i])
              for i in range(3)]
    ids = torch.arange(0, target.config.vocab_size, 3)
    drafts = {}
    for mapped in (True, False):
        head = HotHead(target.lm_head.weight, ids, target.config.vocab_size, SINGLE) if mapped else None
        eager = BlockDrafter(target, draft, 4, None, head).draft(inputs, kept)
        compiled = BlockDrafter(target, draft, 4, "aot_eager", head)
        drafts[mapped] = compiled.draft(inputs, kept)
        assert drafts[mapped] == eager and compiled.compiled is not None
    assert drafts[True] != drafts[False]


def test_a_draft_of_another_width_is_refused(target):
    with pytest.raises(ValueError, match="hidden size 32"):
        BlockDrafter(target, BlockDraftModel(BlockDraftConfig(hidden_size=32, num_heads=2)), 4)


def test_acceptance_on_the_held_out_sample_matches_the_card(target, draft):
    sys.path.insert(0, str(ROOT / "tools"))
    from block_draft_data import PromptSource
    from block_draft_eval import measure
    from corpus import Work
    from tokenizers import Tokenizer

    card = CARD["sample"]
    prompt_len = CARD["protocol"]["prompt_len"]
    text = (DRAFT / card["file"]).read_text(encoding="utf-8")
    source = PromptSource([Work("sample", text)], Tokenizer.from_file(str(TARGET / "tokenizer.json")), prompt_len)
    ks = tuple(int(key[2:]) for key in card if key.startswith("k="))
    got = measure(target, draft, source.spread(card["prompts"]), card["new_tokens"], ks)
    assert got["positions"] == card["positions"]
    for k in ks:      # float32 everywhere: equal here; one flipped near-tie elsewhere moves a step or two
        assert got[f"k={k}"]["acceptance_length"] == pytest.approx(card[f"k={k}"]["acceptance_length"], abs=0.02)


def test_model_card_quotes_eval_json():
    text = (DRAFT / "README.md").read_text()
    tables = re.findall(r"((?:^\| \d+ \| \d+\.\d+ \| [\d,]+ \|\n)+)", text, re.MULTILINE)
    assert len(tables) == 2
    for table, entry in zip(tables, (CARD["held_out"], CARD["sample"])):
        for k, length, steps in re.findall(r"^\| (\d+) \| (\d+\.\d+) \| ([\d,]+) \|$", table, re.MULTILINE):
            assert f"{entry[f'k={k}']['acceptance_length']:.2f}" == length
            assert entry[f"k={k}"]["steps"] == int(steps.replace(",", ""))
    assert sum(f.stat().st_size for f in DRAFT.glob("*.safetensors")) <= 8 * 10**6
