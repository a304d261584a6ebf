"""Text in and out of the engine: loads a model folder's tokenizer, encodes prompts, and streams generated text.

`Tokenizer` wraps a Hugging Face `tokenizers` object together with the special-token settings of
`tokenizer_config.json` and `generation_config.json`. The vocabulary comes from the folder's `tokenizer.json`,
or else from Kimi's `tiktoken.model`, converted at load into the same kind of object (kimi_tokenizer.py), so
everything after loading has one code path. `IncrementalDetokenizer` turns the token ids a request generates, one
at a time, into text that is safe to stream: it never emits half of a multi-byte character (byte-level BPE splits
them across tokens) and never emits any part of a stop string.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from . import kimi_tokenizer
from .byte_level import BYTE_OF_CHAR
from .kimi_tokenizer import TIKTOKEN_FILE

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
PROMPT_CONTEXT_TOKENS = 5     # prompt tokens decoded ahead of the output, so its first token gets its leading space
REPLACEMENT = "\ufffd"        # what decoding yields for bytes that are not (yet) a whole UTF-8 character


class TokenizerError(ValueError):
    """A model folder whose tokenizer files are missing, unreadable or inconsistent; the message names the file."""


@dataclass(frozen=True)
class Vocabulary:
    """A folder's vocabulary as loaded: the backend, the ids it treats as special tokens, how encode cuts text
    before the backend sees it, and the file it came from (named in errors)."""

    backend: tokenizers.Tokenizer
    special_ids: frozenset[int]
    text_pieces: Callable[[str], Iterable[str]]
    file: str


class Tokenizer:
    """A model's tokenizer: tokenizer.json or tiktoken.model for the vocabulary, the configs for BOS, EOS, padding
    and chat."""

    def __init__(self, backend: tokenizers.Tokenizer, *, vocab_size: int, bos_token_id: int | None,
                 eos_token_ids: list[int], pad_token_id: int | None, special_ids: frozenset[int], add_bos_token: bool,
                 chat_template: str | None, text_pieces: Callable[[str], Iterable[str]]):
        self._backend = backend
        self._text_pieces = text_pieces
        self._encode_lock = threading.Lock()      # encode flips the backend's encode_special_tokens switch
        self.added_ids = frozenset(backend.get_added_tokens_decoder())    # special and control tokens
        self.vocab_size = vocab_size            # one more than the highest token id
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.special_ids = special_ids
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load the vocabulary (`tokenizer.json`, else `tiktoken.model`; one is required), `tokenizer_config.json`
        and `generation_config.json` (optional).

        EOS ids are the config's `eos_token` followed by generation_config's `eos_token_id` (an int or a list),
        without repeats. BOS and padding come from tokenizer_config, else from generation_config.
        """
        folder = Path(folder)
        config = load_json_object(folder / TOKENIZER_CONFIG_FILE)
        generation = load_json_object(folder / GENERATION_CONFIG_FILE)
        vocabulary = _load_vocabulary(folder, config)
        backend = vocabulary.backend
        vocab_size = 1 + max(backend.get_vocab(with_added_tokens=True).values())

        def config_token(key: str) -> int | None:
            content = _token_content(config.get(key))
            return None if content is None else _known_token(vocabulary, content, f"{TOKENIZER_CONFIG_FILE} {key}")

        def generation_ids(key: str) -> list[int]:
            return _checked_ids(generation.get(key), vocab_size, f"{GENERATION_CONFIG_FILE} {key}")

        bos = config_token("bos_token")
        bos = bos if bos is not None else next(iter(generation_ids("bos_token_id")), None)
        pad = config_token("pad_token")
        pad = pad if pad is not None else next(iter(generation_ids("pad_token_id")), None)
        eos = config_token("eos_token")
        eos_ids = list(dict.fromkeys(([] if eos is None else [eos]) + generation_ids("eos_token_id")))
        add_bos = bool(config.get("add_bos_token", False))
        if add_bos and bos is None:
            raise TokenizerError(f"{folder / TOKENIZER_CONFIG_FILE} sets add_bos_token but names no bos_token; "
                                 "add a bos_token or set add_bos_token to false.")
        named = [i for i in (bos, pad, *eos_ids) if i is not None]
        special = _special_ids(vocabulary, config) | frozenset(named)
        return cls(backend, vocab_size=vocab_size, bos_token_id=bos, eos_token_ids=eos_ids, pad_token_id=pad,
                   special_ids=special, add_bos_token=add_bos, chat_template=_chat_template(config, folder),
                   text_pieces=vocabulary.text_pieces)

    @classmethod
    def from_folder_or_none(cls, folder: str | Path) -> Tokenizer | None:
        """`from_folder`, or None when the folder has neither tokenizer.json nor tiktoken.model."""
        folder = Path(folder)
        if not (folder / TOKENIZER_FILE).is_file() and not (folder / TIKTOKEN_FILE).is_file():
            return None
        return cls.from_folder(folder)

    def encode(self, text: str, add_special_tokens: bool = True, allow_special: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in it are recognised when `allow_special`, and otherwise
        encoded as the text they spell (as tiktoken's `disallowed_special=()`; with a tokenizer.json this covers the
        added tokens it marks special). With `add_special_tokens`, BOS is prepended iff `add_bos_token`, unless
        the text already starts with it (e.g. from a chat template)."""
        pieces = list(self._text_pieces(text))
        with self._encode_lock:
            self._backend.encode_special_tokens = not allow_special
            encodings = self._backend.encode_batch_fast(pieces, add_special_tokens=False)     # ids without offsets
        ids = [i for encoding in encodings for i in encoding.ids]
        if add_special_tokens and self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; bytes that do not form whole characters decode to U+FFFD."""
        kept = [int(i) for i in ids if not (skip_special_tokens and i in self.special_ids)]
        return self._backend.decode(kept, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for (U+FFFD where it holds only part of a character), for logprob displays."""
        return self._backend.decode([int(token_id)], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token adds to the text (byte-level BPE pieces map back byte for byte), or None for a
        special token or an id the vocabulary lacks."""
        if token_id in self.special_ids or token_id >= self.vocab_size:
            return None
        piece = self._backend.id_to_token(int(token_id))
        if piece is None:
            return None
        if isinstance(self._backend.decoder, tokenizers.decoders.ByteLevel) and token_id not in self.added_ids:
            return bytes(BYTE_OF_CHAR[ch] for ch in piece)
        return self.token_text(token_id).encode()       # added tokens are spelled as text, not byte-level


class IncrementalDetokenizer:
    """Streams the text of generated tokens: never emits broken UTF-8 and never emits any part of a stop string.

    Decoding works on a short window of ids, `ids[prefix:]`. Both `prefix` and `read` sit on character boundaries:
    the text of `ids[prefix:read]` is settled, and the window's text past it is emitted up to its last whole
    character; once the window decodes cleanly to its end, the window moves on to start at `read`. The prompt's
    last few tokens open the first window so the first generated token decodes with its true leading space.

    Text that could begin a stop string is held back until it can be told apart. When several stop strings
    occur, the one that completes first wins (the longest of those ending at the same place).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        if any(not s for s in stop):
            raise ValueError("Stop strings must be non-empty; remove the empty string from `stop`.")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._ids = self._prompt_context(prompt_ids)
        self._prefix = 0
        self._read = len(self._ids)
        self._sent = len(self._decode(0, self._read))   # chars of the window's text passed on so far
        self._held = ""            # decoded text kept back because it may start a stop string
        self._generated = 0
        self.text = ""
        self.stop_string: str | None = None
        self.stop_token_index: int | None = None

    def add(self, token_id: int) -> str:
        """Take one generated token; return the new text that is now safe to emit (may be "")."""
        if self.stop_string is not None:
            return ""
        self._generated += 1
        if self._skip_special and token_id in self._tokenizer.special_ids:
            return ""
        self._ids.append(token_id)
        return self._release(self._settle(final=False), final=False)

    def finish(self) -> str:
        """End of generation: return everything still held back ("" once a stop string matched)."""
        if self.stop_string is not None:
            return ""
        return self._release(self._settle(final=True), final=True)

    def _prompt_context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's last tokens, or none if they end inside a character (they would not cut cleanly)."""
        kept = [int(i) for i in prompt_ids if not (self._skip_special and i in self._tokenizer.special_ids)]
        context = kept[-PROMPT_CONTEXT_TOKENS:]
        return [] if self._tokenizer.decode(context, skip_special_tokens=False).endswith(REPLACEMENT) else context

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=False)

    def _settle(self, final: bool) -> str:
        """New text of the window up to its last whole character (all of it when `final`)."""
        window = self._decode(self._prefix)
        clean = not window.endswith(REPLACEMENT)
        settled = window if clean or final else window.rstrip(REPLACEMENT)
        new = settled[self._sent:]
        self._sent += len(new)
        if clean:
            self._prefix, self._read = self._read, len(self._ids)
            self._sent = len(self._decode(self._prefix, self._read))
        return new

    def _release(self, new: str, final: bool) -> str:
        """Pass `new` text through the stop-string check; return what may be emitted and record it."""
        pending = self._held + new
        match = self._first_stop(pending)
        if match is not None:
            start, stop = match
            out = pending[:start + len(stop) if self._include_stop else start]
            self._held = ""
            self.stop_string, self.stop_token_index = stop, self._generated
        else:
            keep = 0 if final else self._stop_prefix_length(pending)
            out, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += out
        return out

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop string that completes first in `text`, if any does."""
        found = [(start + len(s), start, s) for s in self._stop if (start := text.find(s)) >= 0]
        if not found:
            return None
        _, start, stop = min(found)
        return start, stop

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest


def _load_vocabulary(folder: Path, config: dict[str, Any]) -> Vocabulary:
    """The folder's tokenizer.json, else its tiktoken.model with the reserved tokens config names."""
    if (folder / TOKENIZER_FILE).is_file():
        return _load_tokenizer_json(folder / TOKENIZER_FILE)
    if (folder / TIKTOKEN_FILE).is_file():
        return _load_tiktoken(folder / TIKTOKEN_FILE, config.get("added_tokens_decoder", {}))
    raise TokenizerError(f"No {TOKENIZER_FILE} or {TIKTOKEN_FILE} in {folder}; point at a model folder that has "
                         "one of them.")


def _load_tokenizer_json(path: Path) -> Vocabulary:
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:      # the Rust library raises a bare Exception for any unreadable file
        raise TokenizerError(f"{path} is not a valid Hugging Face tokenizer file ({_first_line(err)}); "
                             "re-download or re-export it.") from err
    if backend.get_vocab_size(with_added_tokens=True) == 0:
        raise TokenizerError(f"{path} has an empty vocabulary; re-download or re-export it.")
    special = frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
    return Vocabulary(backend, special, _whole_text, TOKENIZER_FILE)


def _whole_text(text: str) -> tuple[str]:
    return (text,)


def _load_tiktoken(path: Path, added_tokens_decoder: Any) -> Vocabulary:
    """Kimi's tiktoken ranks and reserved tokens as a byte-level BPE (see kimi_tokenizer.py)."""
    try:
        ranks = kimi_tokenizer.parse_ranks(path.read_bytes())
    except (OSError, ValueError) as err:
        raise TokenizerError(f"{path} is not a valid tiktoken file ({_first_line(err)}); re-download it.") from err
    if not isinstance(added_tokens_decoder, dict):
        raise TokenizerError(f"{path.parent / TOKENIZER_CONFIG_FILE} added_tokens_decoder must be a JSON object; "
                             "fix it.")
    try:
        reserved = kimi_tokenizer.reserved_tokens(len(ranks), added_tokens_decoder)
    except ValueError as err:
        raise TokenizerError(f"{path.parent / TOKENIZER_CONFIG_FILE} does not fit {TIKTOKEN_FILE}: {err}; fix "
                             "its added_tokens_decoder.") from err
    try:
        backend = kimi_tokenizer.bpe_backend(ranks, reserved)
    except ValueError as err:
        raise TokenizerError(f"{path} cannot be served as a byte-level BPE ({err}); kestrel cannot load this "
                             "vocabulary.") from err
    special = frozenset(token.id for token in reserved if token.special)
    return Vocabulary(backend, special, kimi_tokenizer.text_pieces, TIKTOKEN_FILE)


def load_json_object(path: Path) -> dict[str, Any]:
    """An optional JSON object file: {} when absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerError(f"{path} is not readable JSON ({_first_line(err)}); fix or remove it.") from err
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, not {type(data).__name__}; fix or remove it.")
    return data


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _token_content(value: Any) -> str | None:
    """A token named in tokenizer_config.json: a string, or an AddedToken dict with `content`."""
    content = value.get("content") if isinstance(value, dict) else value
    return content if isinstance(content, str) else None


def _known_token(vocabulary: Vocabulary, content: str, where: str) -> int:
    token_id = vocabulary.backend.token_to_id(content)
    if token_id is None:
        raise TokenizerError(f"{where} is {content!r}, which is not in {vocabulary.file}; use a token it has.")
    return token_id


def _checked_ids(value: Any, vocab_size: int, where: str) -> list[int]:
    """Token ids given as an int, a list of ints, or null, each checked to be in the vocabulary."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size:
            raise TokenizerError(f"{where} holds {i!r}, which is not a token id below the vocabulary size "
                                 f"{vocab_size}; fix {GENERATION_CONFIG_FILE}.")
    return ids


def _special_ids(vocabulary: Vocabulary, config: dict[str, Any]) -> frozenset[int]:
    """Ids the vocabulary treats as special, marked special in tokenizer_config's added_tokens_decoder, or listed
    in its additional_special_tokens."""
    ids = set(vocabulary.special_ids)
    for key, token in config.get("added_tokens_decoder", {}).items():
        if isinstance(token, dict) and token.get("special"):
            ids.add(int(key))
    for token in config.get("additional_special_tokens", []):
        content = _token_content(token)
        if content is not None:
            ids.add(_known_token(vocabulary, content, f"{TOKENIZER_CONFIG_FILE} additional_special_tokens"))
    return frozenset(ids)


def _chat_template(config: dict[str, Any], folder: Path) -> str | None:
    """tokenizer_config's chat_template (a string, or a list of named templates: the "default" one), else the
    folder's chat_template.jinja."""
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (folder / CHAT_TEMPLATE_FILE).is_file():
        template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    return template
