"""The bundled model's tokenizer: byte-level BPE trained on the training works, with the K3 special tokens.

As in K3 (model-spec section 10) the BPE ranks come first and the special tokens follow them, in K3's order; the
chat template is kestrel's XTML template, and the generation EOS is `<|end_of_msg|>`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, END_OF_MSG, PAD, UNK = "[BOS]", "[EOS]", "<|end_of_msg|>", "[PAD]", "[UNK]"
SPECIAL_TOKENS = [BOS, EOS, END_OF_MSG, "<|open|>", "<|close|>", "<|sep|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|MASK|>", "[EOT]", UNK, PAD]
"""K3's special tokens (no media tokens: the bundled model reads text only), in K3's id order."""
CHAT_TEMPLATE = Path(__file__).resolve().parent.parent / "kestrel" / "server" / "chat_template.jinja"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE of vocab_size ids in all: vocab_size - len(SPECIAL_TOKENS) ranks, then the special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the corpus yields only {tokenizer.get_vocab_size()} ids; lower the vocabulary size.")
    return tokenizer


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}


def write_tokenizer(tokenizer: Tokenizer, folder: Path, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (BOS added, chat template, EOS `<|end_of_msg|>`) and
    generation_config.json (stop at `<|end_of_msg|>` or `[EOS]`) in `folder`."""
    ids = special_ids(tokenizer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": END_OF_MSG,
        "pad_token": PAD,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (BOS, END_OF_MSG, PAD, UNK)],
        "added_tokens_decoder": {str(ids[t]): {"content": t, "special": True} for t in SPECIAL_TOKENS},
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE.read_text(encoding="utf-8"),
    }
    generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[END_OF_MSG], ids[EOS]], "pad_token_id": ids[PAD],
                  "do_sample": True, "temperature": 0.8, "top_p": 0.95}
    for name, data in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        (folder / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
