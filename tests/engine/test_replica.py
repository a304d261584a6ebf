"""The replica of a published K3 checkpoint folder (tests/replica.py), used as a user's download would be: its
layout, the offline API from a text prompt, and `kestrel serve --model FOLDER` answering /v1/completions and
/tokenize.

Oracles: the tiktoken library over the folder's own tiktoken.model and tokenizer_config.json for token ids, and
the offline API's greedy run for the served completion (served == offline, same float32 weights).
"""

from __future__ import annotations

import json

import pytest
import tiktoken

from kestrel import LLM, SamplingParams
from replica import END_OF_MSG_OFFSET, NUM_RESERVED, tiktoken_encoding
from server_helpers import LiveServer

PROMPT = "The quick brown fox 你好, it's 2026 👍🏽"
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def oracle(k3_replica_dir) -> tiktoken.Encoding:
    return tiktoken_encoding(k3_replica_dir)


@pytest.fixture(scope="module")
def llm(k3_replica_dir) -> LLM:
    return LLM(str(k3_replica_dir), dtype="float32")


def test_replica_has_the_published_layout(k3_replica_dir):
    names = {path.name for path in k3_replica_dir.iterdir()}
    assert "tokenizer.json" not in names
    assert {"config.json", "generation_config.json", "tiktoken.model", "tokenizer_config.json",
            "model.safetensors.index.json"} <= names
    weight_map = json.loads((k3_replica_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1 and shards == sorted(n for n in names if n.endswith(".safetensors"))
    assert all(name.startswith("language_model.") for name in weight_map)
    config = json.loads((k3_replica_dir / "config.json").read_text())
    num_ranks = len((k3_replica_dir / "tiktoken.model").read_text().splitlines())
    assert (config["model_type"], config["architectures"], config["dtype"]) == \
        ("kimi_k3", ["KimiK3ForConditionalGeneration"], "bfloat16")
    assert config["text_config"]["vocab_size"] == num_ranks + NUM_RESERVED
    generation = json.loads((k3_replica_dir / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == num_ranks + END_OF_MSG_OFFSET


def test_llm_generates_from_a_text_prompt(llm, oracle):
    output = llm.generate(PROMPT, SamplingParams(**GREEDY))[0]
    assert output.prompt_token_ids == oracle.encode(PROMPT)
    completion = output.outputs[0]
    assert len(completion.token_ids) == GREEDY["max_tokens"]
    assert completion.text == llm.engine.tokenizer.decode(completion.token_ids)
    assert llm.engine.eos_token_ids[-1] == oracle.encode_single_token("<|end_of_msg|>")


def test_serve_answers_completions_and_tokenize(k3_replica_dir, llm, oracle):
    offline = llm.generate(PROMPT, SamplingParams(**GREEDY))[0].outputs[0].text
    live = LiveServer(k3_replica_dir, dtype="float32")
    try:
        with live.client() as http:
            tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
            assert tokens == oracle.encode(PROMPT)
            marked = http.post("/tokenize", json={"prompt": "hi<|end_of_msg|>"}).json()["tokens"]
            assert marked == oracle.encode("hi<|end_of_msg|>", allowed_special="all")
            assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == PROMPT
            answer = http.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}).json()
            assert answer["choices"][0]["text"] == offline
            assert answer["usage"]["prompt_tokens"] == len(tokens)
            assert answer["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    finally:
        live.stop()
