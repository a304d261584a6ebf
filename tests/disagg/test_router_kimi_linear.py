"""PD through SGLang's router for a Kimi-Linear-format model (random weights, the bundled tokenizer): the same
greedy answers as one `kestrel serve` (prompts longer than a prefill chunk, n > 1, batches, stop strings, streaming);
test_router.py does the same, and the faults, with the bundled model."""

from __future__ import annotations

import shutil

import pytest
import torch

from kestrel.config import parse_config
from kestrel.engine.args import BUNDLED_MODEL
from kestrel.models.checkpoint import build_model, save_model
from kestrel.models.init import init_weights
from kestrel.models.presets import tiny_config
from server_helpers import free_port
from test_router import PROMPT, assert_idle, kestrel, post, router, streamed_text


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    raw = tiny_config("kimi-linear-tiny")
    raw["vocab_size"] = 4096                              # the bundled tokenizer's
    folder = tmp_path_factory.mktemp("kimi-linear")
    save_model(init_weights(build_model(parse_config(raw), torch.float32), seed=0, std=0.1), folder, config_json=raw)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, folder / name)
    model, bootstrap = ["--model", str(folder), "--served-model-name", "k3.1-tiny"], free_port()
    procs = {"u": kestrel(*model),
             "p": kestrel(*model, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)),
             "d": kestrel(*model, "--disaggregation-mode", "decode")}
    try:
        for proc in procs.values():
            proc.wait_ready()
        procs["pd"] = router("--pd-disaggregation", "--prefill", procs["p"].url, str(bootstrap),
                             "--decode", procs["d"].url)
        procs["pd"].wait_ready("/readiness")
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def test_pd_through_the_router_answers_as_one_server(fleet):
    greedy = {"temperature": 0, "max_tokens": 10}
    bodies = [{"prompt": PROMPT, **greedy}, {"prompt": PROMPT, "n": 2, **greedy},
              {"prompt": [PROMPT, "The queen"], **greedy}, {"prompt": PROMPT, "stop": ["e"], **greedy}]
    for body in bodies:
        expected = [c["text"] for c in post(fleet["u"].url, "/v1/completions", body).json()["choices"]]
        got = post(fleet["pd"].url, "/v1/completions", body).json()
        assert [c["text"] for c in got["choices"]] == expected, body
        assert streamed_text(fleet["pd"].url, "/v1/completions", body) == expected, body
    assert_idle(fleet["p"].url, fleet["d"].url)
