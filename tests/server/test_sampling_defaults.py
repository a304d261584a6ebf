"""The model's generation_config.json sets the sampling defaults of requests that leave those fields out (vLLM's
`--generation-config auto`), in the server and the offline API; explicit values win, and a bad file is refused
when the engine starts."""

from __future__ import annotations

import json
import shutil

import pytest

from kestrel import LLM, SamplingParams
from kestrel.engine.sampling import model_sampling_defaults
from kestrel.server.protocol import ChatCompletionRequest, CompletionRequest
from server_helpers import LiveServer


def test_only_the_sampling_fields_are_read(tmp_path):
    assert model_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": None, "eos_token_id": [3, 4]}))
    assert model_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9}


@pytest.mark.parametrize("content, message", [
    ('{"top_p": 0}', "top_p must be in (0, 1]"),
    ('{"temperature": "hot"}', "temperature must be >= 0"),
    ("[1, 2]", "must hold a JSON object"),
    ("{", "is not readable JSON"),
])
def test_a_bad_file_is_refused_with_its_name(tmp_path, content, message):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match="generation_config.json") as error:
        model_sampling_defaults(tmp_path)
    assert message in str(error.value)


def test_request_values_win_over_model_defaults_which_win_over_vllms():
    defaults = {"temperature": 0.6, "top_k": 5, "repetition_penalty": 1.1}
    params = CompletionRequest(prompt="x", temperature=0.2, top_p=0.5).sampling_params(defaults, 16, None)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
        (0.2, 0.5, 5, 0.0, 1.1)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).sampling_params({}, 16, None)
    assert (chat.temperature, chat.top_p, chat.top_k, chat.min_p, chat.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


def test_a_served_model_with_greedy_defaults_answers_greedily(model_folder, tmp_path):
    folder = tmp_path / "greedy"
    shutil.copytree(model_folder, folder)
    (folder / "generation_config.json").write_text('{"temperature": 0.0}')
    live = LiveServer(folder, page_size=4)
    try:
        with live.client() as http:
            body = {"prompt": "to be or not", "max_tokens": 8, "ignore_eos": True, "n": 3}
            unspecified = http.post("/v1/completions", json=body).json()["choices"]
            explicit = http.post("/v1/completions", json={**body, "n": 1, "temperature": 0}).json()["choices"]
            hot = http.post("/v1/completions", json={**body, "n": 4, "temperature": 5.0, "seed": 1}).json()["choices"]
    finally:
        live.stop()
    assert {c["text"] for c in unspecified} == {explicit[0]["text"]}
    assert len({c["text"] for c in hot}) > 1


def test_the_offline_api_uses_the_model_defaults_too(model_folder, tmp_path):
    folder = tmp_path / "greedy"
    shutil.copytree(model_folder, folder)
    (folder / "generation_config.json").write_text('{"temperature": 0.0, "top_p": 0.5}')
    llm = LLM(str(folder))
    assert (llm.get_default_sampling_params().temperature, llm.get_default_sampling_params().top_p) == (0.0, 0.5)
    greedy = llm.generate("to be", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    default = llm.generate({"prompt_token_ids": greedy.prompt_token_ids})[0]
    assert default.outputs[0].token_ids[:6] == greedy.outputs[0].token_ids
