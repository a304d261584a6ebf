"""End-to-end runs against a live kestrel server: each workload, sweeps, the card, evals, and failures."""

from __future__ import annotations

import json

import httpx
import pytest

from kestrel.bench.agentic import AgenticShape, sessions
from kestrel.bench.evals import DATA, EvalClient, choice, extract_answer, generate, perplexity, read_tasks
from kestrel.cli import main
from server_helpers import MODEL_NAME


def bench(live, tmp_path, *args) -> list[dict]:
    out = tmp_path / "results"
    assert main(["bench", "serve", "--base-url", live.url, "--output", str(out), *args]) == 0
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def test_random_workload_is_token_exact_and_sweeps(live, tmp_path):
    results = bench(live, tmp_path, "--workload", "random", "--num-prompts", "6", "--max-concurrency", "1,3",
                    "--input-len", "40", "--output-len", "5", "--range-ratio", "0.5")
    assert [r["config"]["concurrency"] for r in results] == [1, 3]
    for r in results:
        assert r["metrics"]["completed"] == 6 and not r["partial"]
        for request in r["requests"]:
            assert 20 <= request["prompt_tokens"] <= 60 and request["output_tokens"] >= 2
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


def test_agentic_run(live, tmp_path):
    (result,) = bench(live, tmp_path, "--workload", "agentic", "--sessions", "3", "--turns-median", "3",
                      "--length-scale", "1024", "--think-scale", "0.01", "--max-concurrency", "2",
                      "--num-prompts", "12", "--max-context", "2048")
    assert 1 <= result["metrics"]["completed"] <= 12 and result["workload"]["generated"]["sessions"] == 3
    assert result["metrics"]["agentx"]["total_tput_per_gpu"] > 0


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


def test_evals(live):
    client = EvalClient(live.url, MODEL_NAME)
    text = (DATA / "perplexity_sample.txt").read_text()
    ppl = perplexity(client, text)
    ids, _ = client.tokenize(text)
    logprobs = client.prompt_logprobs(ids)
    assert ppl["tokens"] == len(ids) - 1 and ppl["perplexity"] == pytest.approx(
        2.718281828 ** (-sum(logprobs) / len(logprobs)), rel=1e-6)
    assert 0 <= choice(client, read_tasks(DATA / "choice_sample.jsonl"))["accuracy"] <= 1
    assert 0 <= generate(client, read_tasks(DATA / "generate_sample.jsonl")[:2], max_tokens=4)["exact_match"] <= 1
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
