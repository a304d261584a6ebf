"""Training and evaluation windows for the bundled model.

Training windows are `seq_len + 1` tokens: `[BOS]` and then the text of one work from the start of a line (a work
ends with `[EOS]`), or, for a share of windows, the plays' dialogue rendered as XTML chats (one speech per message,
roles alternating, the last speech as the assistant's reply to a generation prompt) packed back to back. Which
windows a step gets depends only on the seed and the step, so a resumed run sees the same data.
Evaluation windows cut a text into consecutive chunks of `seq_len` tokens, each after its own `[BOS]`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from corpus import Work
from tiny_tokenizer import BOS, CHAT_TEMPLATE, EOS

SPEAKER = re.compile(r"^[A-Z][A-Za-z' ]{0,28}\.$")
"""A speech's first line names its speaker: `PROSPERO.`, `Lady Montague.`, `Ber.`."""
REPLY_END = "<|close|>message<|sep|><|end_of_msg|>"
THINK_CLOSE = "<|close|>think<|sep|>"
MAX_TURNS = 4


def speeches(text: str) -> list[str]:
    """The speeches of a play in order: paragraphs opened by a speaker line, without it and stage directions."""
    found = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.strip().split("\n")
        if len(lines) > 1 and SPEAKER.match(lines[0]):
            body = [line.strip() for line in lines[1:] if not line.lstrip().startswith("[")]
            if body:
                found.append("\n".join(body))
    return found


class ChatRenderer:
    """Renders dialogue with the XTML chat template, the reply laid out as the model writes it after a prompt."""

    def __init__(self):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(CHAT_TEMPLATE.read_text(encoding="utf-8"))

    def conversation(self, turns: list[str]) -> str:
        """turns alternate user and assistant and end with the assistant's reply (empty reasoning)."""
        roles = ["user" if (len(turns) - 1 - i) % 2 else "assistant" for i in range(len(turns))]
        history = [{"role": r, "content": t} for r, t in zip(roles[:-1], turns[:-1])]
        prompt = self.template.render(messages=history, tools=None, add_generation_prompt=True)
        return prompt + THINK_CLOSE + turns[-1] + REPLY_END


@dataclass
class TokenizedWork:
    name: str
    ids: torch.Tensor              # [n] int64: the work's tokens, then [EOS]
    line_starts: torch.Tensor      # [m] int64: offsets of tokens that begin a line
    speeches: list[str]


def tokenize_work(work: Work, tokenizer: Tokenizer) -> TokenizedWork:
    encoding = tokenizer.encode(work.text, add_special_tokens=False)
    ids = torch.tensor(encoding.ids + [tokenizer.token_to_id(EOS)], dtype=torch.long)
    starts = [i + 1 for i, (start, end) in enumerate(encoding.offsets[:-1]) if "\n" in work.text[start:end]]
    return TokenizedWork(work.name, ids, torch.tensor([0] + starts, dtype=torch.long), speeches(work.text))


class TrainingData:
    """Deterministic batches of training windows [B, seq_len + 1] over the training works."""

    def __init__(self, works: list[Work], tokenizer: Tokenizer, seq_len: int, chat_fraction: float, seed: int):
        self.tokenizer, self.seq_len, self.chat_fraction, self.seed = tokenizer, seq_len, chat_fraction, seed
        self.bos = tokenizer.token_to_id(BOS)
        self.works = [tokenize_work(w, tokenizer) for w in works]
        self.starts = [(i, int(o)) for i, w in enumerate(self.works) for o in w.line_starts
                       if o + seq_len <= len(w.ids)]
        self.plays = [w for w in self.works if len(w.speeches) > MAX_TURNS]
        self.chat = ChatRenderer()

    @property
    def num_tokens(self) -> int:
        return sum(len(w.ids) for w in self.works)

    def batch(self, step: int, batch_size: int) -> torch.Tensor:
        """Windows [batch_size, seq_len + 1] int64 of training step `step`."""
        rng = random.Random(self.seed * 1_000_003 + step)
        rows = [self._chat_window(rng) if rng.random() < self.chat_fraction else self._text_window(rng)
                for _ in range(batch_size)]
        return torch.stack(rows)

    def _text_window(self, rng: random.Random) -> torch.Tensor:
        work, offset = self.starts[rng.randrange(len(self.starts))]
        body = self.works[work].ids[offset:offset + self.seq_len]
        return torch.cat([torch.tensor([self.bos]), body])

    def _chat_window(self, rng: random.Random) -> torch.Tensor:
        play = self.plays[rng.randrange(len(self.plays))]
        at = rng.randrange(len(play.speeches) - MAX_TURNS)
        ids: list[int] = []
        while len(ids) <= self.seq_len:
            turns = rng.randint(2, MAX_TURNS)
            text = self.chat.conversation(play.speeches[at:at + turns])
            ids += [self.bos] + self.tokenizer.encode(text, add_special_tokens=False).ids
            at = (at + turns) % (len(play.speeches) - MAX_TURNS)
        return torch.tensor(ids[:self.seq_len + 1], dtype=torch.long)


def eval_windows(text: str, tokenizer: Tokenizer, seq_len: int) -> list[torch.Tensor]:
    """The text's tokens in consecutive chunks of seq_len, each after [BOS]: windows of at most seq_len + 1 ids."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    bos = tokenizer.token_to_id(BOS)
    return [torch.tensor([bos] + ids[i:i + seq_len], dtype=torch.long) for i in range(0, len(ids), seq_len)
            if len(ids[i:i + seq_len]) >= 2]
