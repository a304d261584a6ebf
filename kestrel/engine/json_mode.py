"""JSON mode: constrains generation so that the text is always a prefix of one JSON object.

A byte-level pushdown automaton tracks where the output stands in the JSON grammar (RFC 8259, top level an
object). Before each sampling step, every vocabulary token is checked against the current state (masks are
cached per state): a token is allowed if its bytes keep the text a valid prefix; EOS only once the object is
complete. Bytes >= 0x80 are accepted inside strings only, as well-formed UTF-8 (RFC 3629: no overlong forms,
surrogates or code points past U+10FFFF), since a token may end inside a character. At most MAX_SPACE
whitespace bytes may follow each other (room for indented output), so a model cannot stall in whitespace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SPACE = 20
_SPACE = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrtu')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}

# Modes. After a value, the enclosing container decides what may follow (AFTER).
START, VALUE, KEY_OR_END, KEY, COLON, AFTER, VALUE_OR_END, STRING, ESCAPE, UNICODE, UTF8, NUMBER, LITERAL, DONE = \
    range(14)
# Number sub-states: which part was read last.
MINUS, ZERO, INT, DOT, FRAC, EXP, EXP_SIGN, EXP_DIGITS = range(8)
_NUMBER_COMPLETE = frozenset({ZERO, INT, FRAC, EXP_DIGITS})


@dataclass(frozen=True)
class JsonState:
    """Where a text stands in the grammar. stack: "{" / "[" per open container; detail: mode-specific
    (string: whether it is a key; unicode: (is key, hex digits left); utf8: (is key, the byte ranges the
    character's remaining bytes must fall in); number: sub-state; literal: bytes still expected)."""

    mode: int = START
    stack: tuple[str, ...] = ()
    detail: object = None
    spaces: int = 0

    @property
    def complete(self) -> bool:
        return self.mode == DONE


def advance(state: JsonState, data: bytes) -> JsonState | None:
    """The state after `data`, or None when the text would stop being a JSON-object prefix."""
    for byte in data:
        state = _step(state, byte)
        if state is None:
            return None
    return state


def _step(s: JsonState, b: int) -> JsonState | None:
    mode = s.mode
    if mode == STRING:
        if b == ord('"'):
            return JsonState(COLON, s.stack) if s.detail else _after_value(s.stack)
        if b == ord("\\"):
            return JsonState(ESCAPE, s.stack, s.detail)
        if b >= 0x80:
            rest = _utf8_continuations(b)
            return JsonState(UTF8, s.stack, (s.detail, rest)) if rest else None
        return s if b >= 0x20 else None
    if mode == UTF8:
        is_key, ((low, high), *rest) = s.detail
        if not low <= b <= high:
            return None
        return JsonState(UTF8, s.stack, (is_key, tuple(rest))) if rest else JsonState(STRING, s.stack, is_key)
    if mode == ESCAPE:
        if b not in _ESCAPES:
            return None
        return JsonState(UNICODE, s.stack, (s.detail, 4)) if b == ord("u") else JsonState(STRING, s.stack, s.detail)
    if mode == UNICODE:
        is_key, left = s.detail
        if b not in _HEX:
            return None
        return JsonState(STRING, s.stack, is_key) if left == 1 else JsonState(UNICODE, s.stack, (is_key, left - 1))
    if mode == NUMBER:
        part = _number_step(s.detail, b)
        if part is not None:
            return JsonState(NUMBER, s.stack, part)
        return _step(_after_value(s.stack), b) if s.detail in _NUMBER_COMPLETE else None
    if mode == LITERAL:
        if b != s.detail[0]:
            return None
        return _after_value(s.stack) if len(s.detail) == 1 else JsonState(LITERAL, s.stack, s.detail[1:])
    if b in _SPACE:
        return JsonState(mode, s.stack, s.detail, s.spaces + 1) if s.spaces < MAX_SPACE and mode != DONE else None
    return _structural(s, b)


def _structural(s: JsonState, b: int) -> JsonState | None:
    """A non-space byte outside strings, numbers and literals."""
    mode, stack = s.mode, s.stack
    if mode == START:
        return JsonState(KEY_OR_END, ("{",)) if b == ord("{") else None
    if mode in (VALUE, VALUE_OR_END):
        if mode == VALUE_OR_END and b == ord("]"):
            return _close(stack, "[")
        return _value_start(stack, b)
    if mode in (KEY_OR_END, KEY):
        if mode == KEY_OR_END and b == ord("}"):
            return _close(stack, "{")
        return JsonState(STRING, stack, True) if b == ord('"') else None
    if mode == COLON:
        return JsonState(VALUE, stack) if b == ord(":") else None
    if mode == AFTER:
        if b == ord(","):
            return JsonState(KEY if stack[-1] == "{" else VALUE, stack)
        return _close(stack, "{" if b == ord("}") else "[" if b == ord("]") else "")
    return None


def _value_start(stack: tuple[str, ...], b: int) -> JsonState | None:
    if b == ord("{"):
        return JsonState(KEY_OR_END, stack + ("{",))
    if b == ord("["):
        return JsonState(VALUE_OR_END, stack + ("[",))
    if b == ord('"'):
        return JsonState(STRING, stack, False)
    if b == ord("-"):
        return JsonState(NUMBER, stack, MINUS)
    if b in _DIGITS:
        return JsonState(NUMBER, stack, ZERO if b == ord("0") else INT)
    if b in _LITERALS:
        return JsonState(LITERAL, stack, _LITERALS[b])
    return None


def _utf8_continuations(lead: int) -> tuple[tuple[int, int], ...] | None:
    """The ranges of the bytes that must follow UTF-8 lead byte `lead` (RFC 3629's table), or None if it cannot
    start a character."""
    tail = (0x80, 0xBF)
    if 0xC2 <= lead <= 0xDF:
        return (tail,)
    if 0xE0 <= lead <= 0xEF:
        return ({0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F)}.get(lead, tail), tail)
    if 0xF0 <= lead <= 0xF4:
        return ({0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(lead, tail), tail, tail)
    return None


def _number_step(part: int, b: int) -> int | None:
    """The number's next sub-state after byte b, or None if b cannot continue it."""
    digit = b in _DIGITS
    if part == MINUS:
        return (ZERO if b == ord("0") else INT) if digit else None
    if part in (ZERO, INT):
        if digit:
            return INT if part == INT else None
        return DOT if b == ord(".") else EXP if b in b"eE" else None
    if part in (DOT, FRAC):
        if digit:
            return FRAC
        return EXP if part == FRAC and b in b"eE" else None
    if part == EXP:
        return EXP_DIGITS if digit else EXP_SIGN if b in b"+-" else None
    if part in (EXP_SIGN, EXP_DIGITS):
        return EXP_DIGITS if digit else None
    return None


def _after_value(stack: tuple[str, ...]) -> JsonState:
    return JsonState(AFTER, stack) if stack else JsonState(DONE)


def _close(stack: tuple[str, ...], bracket: str) -> JsonState | None:
    if not stack or stack[-1] != bracket:
        return None
    return _after_value(stack[:-1])


class JsonTokenMasks:
    """Which tokens may come next from a state: [V] bool masks over a vocabulary, cached per state."""

    def __init__(self, token_bytes: list[bytes | None], eos_token_ids: list[int]):
        self.token_bytes = token_bytes            # None: never allowed (special tokens)
        self.eos_token_ids = eos_token_ids
        self._cache: dict[JsonState, torch.Tensor] = {}

    def allowed(self, state: JsonState) -> torch.Tensor:
        mask = self._cache.get(state)
        if mask is None:
            mask = torch.zeros(len(self.token_bytes), dtype=torch.bool)
            if state.complete:
                mask[self.eos_token_ids] = True
            else:
                for token, data in enumerate(self.token_bytes):
                    mask[token] = bool(data) and advance(state, data) is not None
            self._cache[state] = mask
        return mask
