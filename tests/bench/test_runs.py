"""End-to-end runs against a live kestrel server: each workload, sweeps, the card, evals, and failures.

Expected values come from outside the client under test: request counts and lengths from the workload's own
specification, eval scores from the served checkpoint run directly (its forward pass, tokenized by the
`tokenizers` library from its tokenizer.json), never from the HTTP answers being checked.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import tokenizers
import torch

from helpers import greedy_generate
from kestrel.bench.agentic import AgenticShape, Chain, sessions
from kestrel.bench.evals import DATA, EvalClient, choice, extract_answer, generate, perplexity, read_tasks
from kestrel.bench.workloads import RandomWorkload
from kestrel.cli import main
from kestrel.engine.args import BUNDLED_MODEL
from kestrel.layers.batch import ForwardBatch
from kestrel.models.checkpoint import load_model
from kestrel.models.kimi import KimiForCausalLM
from server_helpers import MODEL_NAME

HELDOUT_SAMPLE = BUNDLED_MODEL / "heldout_sample.txt"      # the bundled model's card measures its perplexity on it


def bench(live, tmp_path, *args) -> list[dict]:
    out = tmp_path / "results"
    assert main(["bench", "serve", "--base-url", live.url, "--output", str(out), *args]) == 0
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def test_random_workload_is_token_exact_and_sweeps(live, tmp_path):
    """Every measured request is answered with exactly the prompt and output lengths the workload specified
    (the server's usage counts against the specs generated from each level's recorded workload; the first spec is
    the warm-up)."""
    results = bench(live, tmp_path, "--workload", "random", "--num-prompts", "6", "--max-concurrency", "1,3",
                    "--input-len", "40", "--output-len", "5", "--range-ratio", "0.5")
    assert [r["config"]["concurrency"] for r in results] == [1, 3]
    for r in results:
        assert {k: r["workload"][k] for k in ("input_len", "output_len", "range_ratio")} == \
            {"input_len": 40, "output_len": 5, "range_ratio": 0.5}
        specs = RandomWorkload(**{k: v for k, v in r["workload"].items() if k != "name"}).requests(7, live.url)[1:]
        expected = sorted((len(s.body["prompt"]), s.body["max_tokens"]) for s in specs)
        assert all(20 <= n <= 60 and 2 <= out <= 7 for n, out in expected)
        assert (r["metrics"]["completed"], r["metrics"]["failed"], r["partial"]) == (6, 0, False)
        assert sorted((q["prompt_tokens"], q["output_tokens"]) for q in r["requests"]) == expected
        assert "kestrel_requests_total" in r["server_after"]["metrics"]
        assert r["server_before"]["models"]["data"][0]["id"] == MODEL_NAME
    assert (tmp_path / "results" / "summary.md").read_text().count("| random |") == 2


def test_file_workload(live, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "to be or not"}\n{"messages": [{"role": "user", "content": "hi"}], '
                       '"max_tokens": 3}\n')
    (result,) = bench(live, tmp_path, "--workload", "file", "--file", str(prompts), "--num-prompts", "2",
                      "--warmup", "0", "--output-len", "4")
    assert result["metrics"]["completed"] == 2
    assert sorted(r["output_tokens"] for r in result["requests"]) == [3, 4]


def tokens(live, messages, generation_prompt=True) -> list[int]:
    response = httpx.post(live.url + "/tokenize", json={"messages": messages,
                                                          "add_generation_prompt": generation_prompt})
    return response.json()["tokens"]


def test_agentic_prompts_share_the_prefixes_they_claim(live):
    corpus = sessions(AgenticShape(sessions=4, turns_median=4, length_scale=1024, subagent_share=1.0, seed=3,
                                   max_context=2048))
    checked_turns = checked_forks = 0
    for session in corpus:
        previous = None
        main_turns = session.main.turns
        for k, turn in enumerate(main_turns):
            ids = tokens(live, turn.messages)
            if previous is not None:
                assert ids[:len(previous)] == previous            # the whole previous prompt is a prefix
                checked_turns += 1
            previous = ids
            for chain in turn.spawn:                              # forks share the parent's context so far
                first = chain.turns[0]
                shared = tokens(live, first.messages[:first.shared_with_parent], generation_prompt=False)
                assert tokens(live, first.messages)[:len(shared)] == shared
                assert tokens(live, main_turns[k + 1].messages)[:len(shared)] == shared
                checked_forks += 1
    assert checked_turns > 5 and checked_forks >= 1


def chain_requests(chain: Chain) -> int:
    """Requests a chain makes: one per turn, plus those of the sub-agent chains each turn spawns."""
    return sum(1 + sum(chain_requests(child) for child in turn.spawn) for turn in chain.turns)


def test_agentic_run(live, tmp_path):
    """The run sends exactly min(--num-prompts, every turn of every session) requests, all answered."""
    (result,) = bench(live, tmp_path, "--workload", "agentic", "--sessions", "3", "--turns-median", "3",
                      "--length-scale", "1024", "--think-scale", "0.01", "--max-concurrency", "2",
                      "--num-prompts", "4", "--max-context", "2048")
    shape = AgenticShape(**result["workload"]["shape"])
    assert shape == AgenticShape(sessions=3, turns_median=3, length_scale=1024, max_context=2048, seed=shape.seed)
    corpus = sessions(shape)
    available = sum(chain_requests(s.main) for s in corpus)
    assert available > 4                                    # so the cap, not the corpus, ends the run
    assert (result["metrics"]["completed"], result["metrics"]["failed"]) == (4, 0)
    assert result["workload"]["generated"]["sessions"] == 3
    assert result["workload"]["generated"]["requests"] == available
    assert result["metrics"]["agentx"]["total_tput_per_gpu"] > 0
    cache = result["prefix_cache"]          # the server counts the same prompt tokens that /tokenize gave
    assert cache["server"]["queried_tokens"] == cache["theoretical"]["prompt_tokens"] > 0


def test_card(live, tmp_path):
    results = bench(live, tmp_path, "--workload", "random", "--num-prompts", "3", "--max-concurrency", "1,2",
                    "--input-len", "20", "--output-len", "4")
    assert len(results) == 2
    out = tmp_path / "card"
    assert main(["bench", "card", *map(str, (tmp_path / "results").glob("*.json")), "--output", str(out),
                 "--hardware", "2-core CPU", "--recipe", "kestrel serve --page-size 4"]) == 0
    card = (out / "card.md").read_text()
    assert "| hardware | 2-core CPU |" in card and MODEL_NAME in card and "kestrel serve --page-size 4" in card
    for png in ("throughput.png", "latency.png", "tradeoff.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


@dataclass
class Reference:
    """The served checkpoint, run directly: its model in float32 and its tokenizer.json."""

    model: KimiForCausalLM
    tokenizer: tokenizers.Tokenizer
    bos: int
    eos: int

    def encode(self, text: str) -> list[int]:
        """[BOS] then the text's ids, as the served tokenizer_config (add_bos_token) asks."""
        return [self.bos] + self.tokenizer.encode(text, add_special_tokens=False).ids

    @torch.no_grad()
    def token_logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[i] | ids[:i]) for i >= 1, from one forward pass over the whole sequence, in float64."""
        hidden = self.model(torch.tensor(ids), ForwardBatch.build([len(ids)]))
        logprobs = self.model.compute_logits(hidden[:-1]).double().log_softmax(-1)
        return logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


@pytest.fixture(scope="module")
def reference(bench_model_folder: Path) -> Reference:
    tokenizer = tokenizers.Tokenizer.from_file(str(bench_model_folder / "tokenizer.json"))
    model = load_model(bench_model_folder, dtype=torch.float32).eval()
    return Reference(model, tokenizer, tokenizer.token_to_id("[BOS]"), tokenizer.token_to_id("<|end_of_msg|>"))


def test_perplexity_eval_equals_a_direct_forward_pass(live, reference):
    """Oracle: exp of the mean negative log-likelihood from one forward pass of the checkpoint (the text is one
    window: far shorter than the context)."""
    text = HELDOUT_SAMPLE.read_text()[:400]
    ids = reference.encode(text)
    logprobs = reference.token_logprobs(ids)
    assert 2 < len(ids) < 512
    expected = {"tokens": len(ids) - 1, "perplexity": pytest.approx(math.exp(-sum(logprobs) / len(logprobs)),
                                                                    rel=1e-5)}
    assert perplexity(EvalClient(live.url, MODEL_NAME), text) == expected


def test_perplexity_eval_scores_the_model_cards_held_out_sample_by_default(live, capsys):
    """Without --file, `kestrel eval perplexity` scores the bundled model's held-out sample (the text its model card
    measures) and names it in its output."""
    assert main(["eval", "perplexity", "--base-url", live.url]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["file"] == str(HELDOUT_SAMPLE)
    assert {k: result[k] for k in ("tokens", "perplexity")} == \
        perplexity(EvalClient(live.url, MODEL_NAME), HELDOUT_SAMPLE.read_text())


@pytest.mark.parametrize("command", ["bench", "eval"])
def test_requests_are_not_logged(live, tmp_path, caplog, command):
    """httpx's INFO line per request stays out of bench and eval output (it would interleave with the progress
    bar), whatever level its logger had."""
    text = tmp_path / "text.txt"
    text.write_text("to be or not to be")
    argv = {"bench": ["bench", "serve", "--num-prompts", "1", "--warmup", "0", "--input-len", "8", "--output-len", "2",
                      "--output", str(tmp_path / "results")],
            "eval": ["eval", "perplexity", "--file", str(text)]}[command]
    caplog.set_level(logging.INFO, logger="httpx")
    assert main([*argv, "--base-url", live.url]) == 0
    assert [r.getMessage() for r in caplog.records if r.name.startswith("httpx")] == []


def test_choice_eval_equals_direct_log_likelihoods(live, reference):
    """Oracle: per task, the summed (and per-token) log-likelihood of each continuation's tokens after the prefix
    it shares with the context, from a direct forward pass; the argmax against the answer. The winning margins
    are checked to be far above float32 noise, so the expected accuracies are not a matter of rounding."""
    tasks = read_tasks(DATA / "choice_sample.jsonl")
    correct = correct_norm = 0
    for task in tasks:
        context = reference.encode(task["context"])
        sums, means = [], []
        for continuation in task["choices"]:
            ids = reference.encode(task["context"] + continuation)
            shared = next((i for i, (a, b) in enumerate(zip(context, ids)) if a != b), len(context))
            tail = reference.token_logprobs(ids)[shared - 1:]
            sums.append(sum(tail))
            means.append(sum(tail) / len(tail))
        for scores in (sums, means):
            best, second = sorted(scores, reverse=True)[:2]
            assert best - second > 1e-3
        correct += sums.index(max(sums)) == task["answer"]
        correct_norm += means.index(max(means)) == task["answer"]
    expected = {"tasks": len(tasks), "accuracy": correct / len(tasks), "accuracy_norm": correct_norm / len(tasks)}
    assert choice(EvalClient(live.url, MODEL_NAME), tasks) == expected


def test_generate_eval_equals_plain_greedy_decoding(live, reference):
    """Oracle: greedy continuations by the plain token-by-token computation (tests/helpers.greedy_generate),
    decoded by tokenizer.json, cut at the stop string, answers extracted and compared."""
    tasks = read_tasks(DATA / "generate_sample.jsonl")[:2]
    prompts = [reference.encode(task["prompt"]) for task in tasks]
    outputs = greedy_generate(reference.model, prompts, max_new_tokens=4, stop_token_id=reference.eos)
    texts = [reference.tokenizer.decode(ids, skip_special_tokens=True).split("\n\n")[0] for ids in outputs]
    hits = sum(extract_answer(text) == str(task["answer"]) for text, task in zip(texts, tasks))
    result = generate(EvalClient(live.url, MODEL_NAME), tasks, max_tokens=4)
    assert result == {"tasks": 2, "exact_match": hits / 2}


def test_extract_answer():
    assert extract_answer("so 3 + 4 = 7\n#### 1,204") == "1204" and extract_answer("it is 42.") == "42"
    assert extract_answer("no numbers") is None


def test_bad_servers(live, tmp_path, capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--output",
                 str(tmp_path / "x")]) == 2
    assert "cannot reach" in capsys.readouterr().err
    (result,) = bench(live, tmp_path, "--model", "no-such-model", "--num-prompts", "2", "--warmup", "0",
                      "--input-len", "10", "--output-len", "2")
    assert result["partial"] and result["metrics"]["failed"] == 2
    assert "HTTP 404" in next(iter(result["metrics"]["failure_reasons"]))
