"""Command-line flags as an ordered list of (flag, values), so recipes can add, replace and drop flags and print
them back exactly; `<...>` placeholders print as they are."""

from __future__ import annotations

import re
import shlex

Flags = list[tuple[str, list[str]]]

_NEEDS_QUOTES = re.compile(r"[\s'\"{}$`\\]")


def parse_flags(text: str) -> Flags:
    """'--tp-size 8 --cuda-graph-bs-decode 2 4 --enable-x' -> [('--tp-size', ['8']), ('--cuda-graph-bs-decode',
    ['2', '4']), ('--enable-x', [])]."""
    flags: Flags = []
    for token in shlex.split(text):
        if token.startswith("--"):
            flags.append((token, []))
        elif flags:
            flags[-1][1].append(token)
        else:
            raise ValueError(f"flag text must start with a --flag, got {text!r}.")
    return flags


def _quote(token: str) -> str:
    return shlex.quote(token) if _NEEDS_QUOTES.search(token) else token


def render_flags(flags: Flags) -> str:
    return " ".join(" ".join([name, *map(_quote, values)]) for name, values in flags)


def flag_value(flags: Flags, name: str) -> str | None:
    """The first value of `name`, '' for a switch, None when absent."""
    for flag, values in flags:
        if flag == name:
            return values[0] if values else ""
    return None


def has_flag(flags: Flags, name: str) -> bool:
    return flag_value(flags, name) is not None


def set_flag(flags: Flags, name: str, *values: str) -> Flags:
    """A copy with `name` set to `values` (in place when present, else appended)."""
    if has_flag(flags, name):
        return [(flag, list(values) if flag == name else vals) for flag, vals in flags]
    return [*flags, (name, list(values))]


def drop_flags(flags: Flags, *names: str) -> Flags:
    return [(flag, values) for flag, values in flags if flag not in names]


def _negation(name: str) -> str:
    """'--no-enable-x' <-> '--enable-x'."""
    return "--" + name[5:] if name.startswith("--no-") else "--no-" + name[2:]


def merge_flags(base: Flags, overlay: Flags) -> Flags:
    """`base` with every flag of `overlay` set (overlay values win, new flags appended; a --no-x in the overlay
    replaces a --x of the base and the other way round)."""
    for name, values in overlay:
        base = set_flag(drop_flags(base, _negation(name)), name, *values)
    return base
