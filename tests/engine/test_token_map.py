"""--speculative-token-map (FR-Spec): model drafters draft among the map's tokens only, through their LM head cut to
the map's rows; greedy output stays plain greedy output, and the cut head is in the memory plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.distributed.parallel import SINGLE
from kestrel.engine.args import BUNDLED_MODEL, EngineArgs
from kestrel.engine.speculative.token_map import HotHead, load_token_map
from helpers import assert_idle

ROOT = Path(__file__).resolve().parents[2]
DRAFT = BUNDLED_MODEL.parent / "k3.1-tiny-dflash"
SHIPPED_MAP = BUNDLED_MODEL / "token_map.pt"
PROMPTS = ["KING.\nWhat news from France?\n\nMESSENGER.\n", "ROMEO.\nBut soft,", "To be, or not to be"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ALGORITHMS = {"NEXTN": {}, "DFLASH": {"speculative_draft_model_path": str(DRAFT)}}


def test_a_map_loads_as_its_distinct_ids_ascending(tmp_path):
    path = tmp_path / "map.pt"
    torch.save(torch.tensor([7, 3, 7, 0], dtype=torch.int32), path)
    assert load_token_map(path, 8).tolist() == [0, 3, 7]
    torch.save([5, 1], path)                                      # a list of ids, as some maps are saved
    assert load_token_map(path, 8).tolist() == [1, 5]


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"not a torch file", "not a torch-saved tensor"),
    (torch.tensor([[1, 2]]), "1-D integer tensor"),
    (torch.tensor([1.0, 2.0]), "1-D integer tensor"),
    (torch.tensor([], dtype=torch.long), "1-D integer tensor"),
    (torch.tensor([3, 8]), "outside the model's vocabulary of 8"),
    (torch.tensor([-1, 3]), "outside the model's vocabulary of 8"),
])
def test_a_bad_map_is_refused_with_one_sentence(tmp_path, content, message):
    path = tmp_path / "map.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(ValueError, match=message):
        load_token_map(path, 8)


def test_the_hot_head_is_the_full_heads_argmax_among_the_maps_tokens():
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(50, 16, generator=gen), torch.randn(3, 7, 16, generator=gen)
    ids = torch.randperm(50, generator=gen)[:12].sort().values
    masked = torch.full((50,), float("-inf"))
    masked[ids] = 0
    expected = (x @ weight.t() + masked).argmax(-1)
    assert torch.equal(HotHead(weight, ids, 50, SINGLE)(x), expected)
    assert not torch.equal(expected, (x @ weight.t()).argmax(-1))      # the map changed some choices


def test_a_map_is_only_for_the_drafters_with_an_lm_head():
    with pytest.raises(ValueError, match="speculative_token_map"):
        EngineArgs(model=str(BUNDLED_MODEL), speculative_algorithm="NGRAM", speculative_token_map=str(SHIPPED_MAP))


@pytest.fixture(scope="module")
def plain_tokens() -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(str(BUNDLED_MODEL), dtype="float32").generate(PROMPTS, GREEDY)]


def run(llm: LLM) -> tuple[list[list[int]], torch.Tensor]:
    """PROMPTS' greedy tokens (nothing left behind after) and every token the drafter proposed [drafts]."""
    drafter, proposed = llm.engine.drafter, []
    draft = drafter.draft

    def recorded(*args):
        drafts = draft(*args)
        proposed.extend(t for d in drafts for t in d)
        return drafts
    drafter.draft = recorded
    outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert_idle(llm.engine.scheduler)
    return outputs, torch.tensor(proposed)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_drafts_come_from_the_map_and_greedy_output_stays_plain(tmp_path, plain_tokens, algorithm):
    """The map is the shipped one without the 40 tokens the unrestricted drafter proposes most, so the restriction
    bites; drafts are the map's tokens only, the output is plain greedy output, and the cut head's bytes are in the
    plan."""
    args = dict(dtype="float32", speculative_algorithm=algorithm, speculative_num_draft_tokens=4,
                **ALGORITHMS[algorithm])
    free = LLM(str(BUNDLED_MODEL), **args)
    outputs, free_drafts = run(free)
    assert outputs == plain_tokens
    common = free_drafts.bincount().argsort(descending=True)[:40]
    ids = load_token_map(SHIPPED_MAP, 4096)
    ids = ids[~torch.isin(ids, common)]
    path = tmp_path / "map.pt"
    torch.save(ids, path)
    mapped = LLM(str(BUNDLED_MODEL), speculative_token_map=str(path), **args)
    outputs, mapped_drafts = run(mapped)
    assert outputs == plain_tokens
    assert torch.isin(mapped_drafts, ids).all() and not torch.isin(free_drafts, ids).all()
    head = mapped.engine.drafter.hot_head
    assert head.weight.shape == (len(ids), 192)
    assert mapped.engine.plan.weight_bytes == free.engine.plan.weight_bytes + head.weight.nbytes + head.ids.nbytes


def test_the_tool_keeps_the_most_frequent_tokens_ties_to_the_lower_id():
    sys.path.insert(0, str(ROOT / "tools"))
    from token_map import hot_ids
    counts = torch.tensor([5, 0, 9, 5, 1, 5])
    assert hot_ids(counts, 3).tolist() == [0, 2, 3]           # 9, then two of the three 5s: ids 0 and 3


def test_the_shipped_map_holds_the_bundled_models_greedy_tokens():
    """tools/token_map.py's map of 1,024 ids: it holds nearly all of the model's greedy tokens on the held-out
    sample (the tool measured 99.75% on the held-out works), which are what its drafts must propose."""
    ids = torch.load(SHIPPED_MAP, weights_only=True)
    assert ids.dtype == torch.long and ids.tolist() == sorted(set(ids.tolist())) and len(ids) == 1024
    text = (BUNDLED_MODEL / "heldout_sample.txt").read_text()
    llm = LLM(str(BUNDLED_MODEL), dtype="float32")
    prompts = [{"prompt_token_ids": llm.engine.tokenizer.encode(text[i:i + 200], add_special_tokens=False)}
               for i in range(0, 4000, 500)]
    greedy = torch.tensor([t for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40,
                                                                            ignore_eos=True))
                           for t in o.outputs[0].token_ids])
    assert torch.isin(greedy, ids).float().mean() >= 0.98
