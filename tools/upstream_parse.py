"""Parse server argument lists with an engine's own argument parser; run by tools/check_upstream_parsers.py.

This file runs inside the upstream venv (.cache/upstream-venv), never in kestrel's: it imports SGLang, vLLM or
SGLang's router and nothing of kestrel. Usage: `python tools/upstream_parse.py ENGINE COMMANDS.json RESULTS.json`
with ENGINE one of sglang, vllm, sglang_router. COMMANDS is a JSON list of {"head": "sglang serve", "argv": [...]}
(argv: what follows the head `sglang serve`, `python -m sglang.launch_server`, `vllm serve` or `python -m
sglang_router.launch_router`); RESULTS gets the engine's version and one {"rejections": [{"flag", "value",
"message"}, ...]} per command, in order, empty when the engine accepts the arguments.

How each engine is asked:
- SGLang: the head is handled by SGLang's own code (`sglang.cli.serve._extract_model_type_override` and
  `_normalize_positional_model_path` for `sglang serve`; nothing for `python -m sglang.launch_server`, which passes
  sys.argv[1:]), then `sglang.srt.server_args.prepare_server_args(argv)`: SGLang's argparse parser built by
  `ServerArgs.add_cli_args`, `parse_args`, and `ServerArgs.from_cli_args`. (In 0.5.23 that constructor resolves
  nothing; the launcher's `resolve_once()`, which reads the checkpoint's config and probes the GPU, is not run.)
- vLLM: the parser `vllm serve` builds (a `FlexibleArgumentParser` with a `serve` subparser filled by
  `vllm.entrypoints.common.cli_args.make_arg_parser`), `parse_args(["serve", *argv])`, then
  `validate_parsed_serve_args` and `AsyncEngineArgs.from_cli_args` (no engine config: that needs the model's config
  from the hub). VLLM_TARGET_DEVICE=cpu is set so that vLLM's device probe answers without a GPU.
- SGLang's router: `sglang_router.launch_router.parse_router_args(argv)` (its argparse parser from
  `RouterArgs.add_cli_args`, then `RouterArgs.from_cli_args`) and `RouterArgs._validate_router_args()`, which is what
  `python -m sglang_router.launch_router` runs before it starts the router.

argparse stops at the first bad value, so after each rejection the offending option (with its values) is dropped and
the rest parsed again, until the parser accepts what is left: every rejected flag is reported, not just the first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

MAX_ROUNDS = 50


class Rejected(Exception):
    """What the engine's argparse parser would have printed before exiting with status 2."""


_extras: list[list[str]] = []
_parse_known_args = argparse.ArgumentParser.parse_known_args


def _recording_parse_known_args(self, args=None, namespace=None):
    parsed, extras = _parse_known_args(self, args, namespace)
    _extras.append(list(extras))
    return parsed, extras


def _raise(self, message):
    raise Rejected(message)


# The engines build their parsers inside their own functions: error() raising instead of exiting, and the leftover
# tokens of the last parse_known_args, are all this script changes about them.
argparse.ArgumentParser.error = _raise
argparse.ArgumentParser.parse_known_args = _recording_parse_known_args


def _is_option(token: str) -> bool:
    return token.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", token)


def _group_unrecognized(extras: list[str]) -> list[tuple[str | None, str | None]]:
    """`--flag v1 v2 stray` -> [("--flag", "v1 v2"), (None, "stray")]."""
    groups: list[list[str]] = []
    for token in extras:
        if _is_option(token) or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    result = []
    for group in groups:
        if _is_option(group[0]):
            flag, _, inline = group[0].partition("=")
            values = ([inline] if inline else []) + group[1:]
            result.append((flag, " ".join(values) or None))
        else:
            result.append((None, " ".join(group)))
    return result


def _drop_tokens(argv: list[str], tokens: list[str]) -> list[str]:
    """argv without the first occurrence of each of `tokens`, in order."""
    argv, start = list(argv), 0
    for token in tokens:
        if token in argv[start:]:
            index = argv.index(token, start)
            del argv[index]
            start = index
    return argv


def _drop_option(argv: list[str], names: list[str], bad: str | None) -> tuple[list[str], str | None, str | None]:
    """argv without one use of the option called any of `names` (the one whose values hold `bad`, the value the
    parser quoted, else the first) and the values after it."""
    uses = []
    for index, token in enumerate(argv):
        flag, eq, inline = token.partition("=")
        if flag in names:
            end = index + 1
            if not eq:
                while end < len(argv) and not _is_option(argv[end]):
                    end += 1
            uses.append((index, end, flag, [inline] if eq else argv[index + 1:end]))
    if not uses:
        return argv, None, None
    index, end, flag, values = next((use for use in uses if bad in use[3]), uses[0])
    return argv[:index] + argv[end:], flag, " ".join(values) or None


def parse_repeatedly(parse, argv: list[str]) -> list[dict]:
    """Every rejection `parse` raises for argv, dropping each rejected option and parsing again."""
    rejections: list[dict] = []
    for _ in range(MAX_ROUNDS):
        _extras.clear()
        try:
            parse(list(argv))
            return rejections
        except Rejected as rejected:
            message = str(rejected)
            if message.startswith("unrecognized arguments:") and _extras and _extras[-1]:
                extras = _extras[-1]
                for flag, value in _group_unrecognized(extras):
                    rejections.append({"flag": flag, "value": value, "message": f"unrecognized arguments: "
                                       f"{' '.join(t for t in (flag, value) if t)}"})
                remaining = _drop_tokens(argv, extras)
            elif match := re.match(r"argument ([^:]+): ", message):
                names = match.group(1).split("/")
                quoted = re.search(r"'(.*)'", message[match.end():])
                remaining, flag, value = _drop_option(argv, names, quoted.group(1) if quoted else None)
                rejections.append({"flag": flag or names[0], "value": value, "message": message})
            else:
                rejections.append({"flag": None, "value": None, "message": message})
                return rejections
        except Exception as error:  # a constructor or validator of the engine refused the parsed values
            rejections.append({"flag": None, "value": None, "message": f"{type(error).__name__}: {error}"})
            return rejections
        if remaining == argv:
            return rejections
        argv = remaining
    rejections.append({"flag": None, "value": None, "message": f"gave up after {MAX_ROUNDS} rejections"})
    return rejections


def sglang_parser():
    from sglang.cli.serve import _extract_model_type_override, _normalize_positional_model_path
    from sglang.srt.server_args import prepare_server_args

    def parse(head: str, argv: list[str]) -> None:
        if head == "sglang serve":  # what sglang.cli.serve.serve does before it hands argv to the LLM backend
            backend, argv = _extract_model_type_override(argv)
            argv, _ = _normalize_positional_model_path(argv)
            if backend not in ("auto", "llm"):
                raise Rejected(f"--model-type {backend}: not the LLM backend, which this check parses")
        prepare_server_args(argv)
    return parse


def vllm_parser():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parse(head: str, argv: list[str]) -> None:
        parser = FlexibleArgumentParser(prog="vllm")
        subparsers = parser.add_subparsers(dest="subparser")
        make_arg_parser(subparsers.add_parser("serve", usage="vllm serve [model_tag] [options]"))
        args = parser.parse_args(["serve", *argv])
        if args.model_tag is not None:          # what ServeSubcommand.cmd does first
            args.model = args.model_tag
        validate_parsed_serve_args(args)
        AsyncEngineArgs.from_cli_args(args)
    return parse


def router_parser():
    from sglang_router.launch_router import parse_router_args

    def parse(head: str, argv: list[str]) -> None:
        parse_router_args(argv)._validate_router_args()   # what launch_router.main() does before starting the router
    return parse


def engine_version(engine: str) -> str:
    if engine == "sglang_router":
        from sglang_router.version import __version__
        return __version__
    return __import__(engine).__version__


def main() -> None:
    engine = sys.argv[1]
    parse = {"sglang": sglang_parser, "vllm": vllm_parser, "sglang_router": router_parser}[engine]()
    with open(sys.argv[2]) as f:
        commands = json.load(f)
    results = [{"rejections": parse_repeatedly(lambda argv, head=c["head"]: parse(head, argv), c["argv"])}
               for c in commands]
    with open(sys.argv[3], "w") as f:   # a file, not stdout: the engines log and warn as they import
        json.dump({"engine": engine, "version": engine_version(engine), "results": results}, f)


if __name__ == "__main__":
    main()
