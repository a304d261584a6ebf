"""Server test helpers: a tiny random K3.1 model with an XTML tokenizer and chat template, served on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import tokenizers
import torch
import uvicorn
from tokenizers import decoders, models, pre_tokenizers, trainers

from kestrel.config import parse_config
from kestrel.engine.args import EngineArgs
from kestrel.engine.async_engine import AsyncEngine
from kestrel.engine.engine import LLMEngine
from kestrel.models.checkpoint import build_model, save_model
from kestrel.models.init import init_weights
from kestrel.models.presets import tiny_config
from kestrel.server.app import create_app
from kestrel.server.chat import XTML_CHAT_TEMPLATE
from kestrel.server.options import ServerOptions

VOCAB = 400
SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "<|MASK|>"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "to be or not to be, that is the question",
          'message role="user" think tool_call name="get_weather" {"city": "Paris"} tools',
          "all the world's a stage, and all the men and women merely players", "héllo wörld 你好 🙂"] * 20
MODEL_NAME = "k3.1-tiny-test"


def write_model_folder(folder: Path) -> None:
    raw = tiny_config("k3.1-tiny")
    raw["text_config"].update(vocab_size=VOCAB, bos_token_id=1, eos_token_id=3, pad_token_id=0)
    model = init_weights(build_model(parse_config(raw), torch.float32), seed=0, std=0.1)
    save_model(model, folder, config_json=raw)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    template = XTML_CHAT_TEMPLATE.read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>", "pad_token": "[PAD]", "add_bos_token": True,
        "additional_special_tokens": SPECIALS[3:], "chat_template": template}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_kestrel_serve(*args: str) -> tuple[subprocess.Popen, str]:
    """`kestrel serve --port P *args` as users run it, in its own process; (process, base URL) once /health
    answers 200."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", "--port", str(port), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            if time.time() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError(f"kestrel serve did not come up: {process.communicate()[0][-2000:]}")
            time.sleep(0.2)


class LiveServer:
    """A kestrel app served by uvicorn on a loopback port, in a background thread."""

    def __init__(self, folder: Path, options: ServerOptions | None = None, **engine_args):
        self.engine = AsyncEngine(LLMEngine(EngineArgs(model=str(folder), **engine_args)))
        self.app = create_app(self.engine, options or ServerOptions(MODEL_NAME))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, **{"timeout": 60, **kw})

    def num_tasks(self) -> int:
        """asyncio tasks alive on the server's event loop (besides the one counting them)."""
        async def count() -> int:
            return len(asyncio.all_tasks()) - 1
        return asyncio.run_coroutine_threadsafe(count(), self.server.servers[0].get_loop()).result(10)
