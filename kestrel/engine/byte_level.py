"""GPT-2's byte-level alphabet: the printable character that stands for each byte in a byte-level BPE vocabulary.

Byte-level BPE vocabularies (tokenizer.json files, and the ones kestrel converts from tiktoken ranks) spell every
token as one such character per byte, so a token's bytes are recovered character by character.
"""

from __future__ import annotations


def _char_of_byte() -> dict[int, str]:
    """Printable Latin-1 bytes stand for themselves; the others take the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


CHAR_OF_BYTE = _char_of_byte()
BYTE_OF_CHAR = {char: byte for byte, char in CHAR_OF_BYTE.items()}
