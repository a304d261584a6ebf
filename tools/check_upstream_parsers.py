"""Parse every SGLang and vLLM server command the cookbook emits with the engines' own argument parsers.

`make check-recipes` runs it. It installs the engines from PyPI into their own venv (.cache/upstream-venv, ignored
by git): SGLang, vLLM and SGLang's router (kestrel's pin of sglang-router) with --no-deps, the pinned CPU torch, and
only the packages their argument modules import (no CUDA). It takes every recipe the golden-file test enumerates
(tests/cookbook/test_cookbook_golden.py's `golden_text`: the same requests at the same pinned RAM), strips each
command's environment assignments and its head (`sglang serve`, `python3 -m sglang.launch_server`, `vllm serve`,
`python3 -m sglang_router.launch_router`), fills the placeholders once per node (`--node-rank <rank>` becomes
0..nnodes-1, `<node-index x 4>` 0, 4, ...), and has tools/upstream_parse.py parse each distinct argument list in the
upstream venv with SGLang's `prepare_server_args`, vLLM's `vllm serve` parser and the router's `parse_router_args`.
It prints each rejected flag or value with its recipe ids and writes tests/cookbook/golden/upstream_check.json: the
date, the versions, how many commands were parsed, every rejection, and the sha256 of the golden file it checked
(the golden-file test fails when the golden file changes without a new check, or when the record lists a
rejection). `vllm-router` lines (a Rust binary) are counted, not parsed.

Exits 1 when an engine rejects something, 2 when the golden file is stale (refresh it first).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".cache" / "upstream-venv"
RECORD = ROOT / "tests" / "cookbook" / "golden" / "upstream_check.json"
CHILD = ROOT / "tools" / "upstream_parse.py"

TORCH = "torch==2.13.0"  # kestrel's pin (pyproject.toml); the CPU build
ENGINES = {"sglang": "sglang==0.5.23", "vllm": "vllm==0.34.0",
           "sglang_router": "sglang-router==0.3.2"}  # kestrel's own pin of SGLang's router (pyproject.toml, test)
IMPORTS = {
    # What `sglang.srt.server_args` and `sglang.cli.serve` import, found by importing until nothing was missing.
    "sglang": ["numpy==2.4.6", "orjson==3.13.0", "psutil==7.2.2", "pybase64==1.5.1", "requests==2.34.2",
               "triton==3.9.0", "packaging==26.4", "pillow==13.0.0", "starlette==1.10.0", "msgspec==0.23.0",
               "pydantic==2.14.4", "pyzmq==27.3.0", "tqdm==4.70.1", "ipython==9.19.1", "aiohttp==3.14.5",
               "huggingface_hub==2.4.0"],
    # What `vllm.entrypoints.common.cli_args` and `vllm.engine.arg_utils` import, found the same way.
    "vllm": ["packaging==26.4", "regex==2026.12.2", "pyyaml==6.0.4", "pydantic==2.14.4", "numpy==2.4.6",
             "psutil==7.2.2", "pyzmq==27.3.0", "urllib3==2.8.0", "transformers==5.25.0", "aiohttp==3.14.5",
             "requests==2.34.2", "fastapi==0.165.0", "pillow==13.0.0", "pybase64==1.5.1", "cachetools==8.0.3",
             "prometheus_client==0.26.0", "openai==3.63.0", "openai-harmony==0.0.8", "cbor2==6.3.0",
             "msgspec==0.23.0", "cloudpickle==3.1.3", "uvloop==0.23.0", "py-cpuinfo==9.0.0",
             "partial-json-parser==0.2.1.1.post7", "llguidance==1.9.1", "xgrammar==0.2.9"],
    # What `sglang_router.launch_router` imports beyond its Rust extension.
    "sglang_router": ["setproctitle==1.3.8", "uvicorn==0.55.0"],
}
HEADS = {  # how a server command starts -> the engine whose parser reads the rest
    ("sglang", "serve"): "sglang",
    ("python", "-m", "sglang.launch_server"): "sglang",
    ("python3", "-m", "sglang.launch_server"): "sglang",
    ("vllm", "serve"): "vllm",
    ("python", "-m", "sglang_router.launch_router"): "sglang_router",
    ("python3", "-m", "sglang_router.launch_router"): "sglang_router",
}
PARSED_WITH = {  # what tools/upstream_parse.py runs, for the record
    "sglang": "sglang.cli.serve's head handling, then sglang.srt.server_args.prepare_server_args(argv): argparse "
              "from ServerArgs.add_cli_args + ServerArgs.from_cli_args (not resolve_once: checkpoint config and GPU)",
    "vllm": "FlexibleArgumentParser + make_arg_parser (`vllm serve`'s parser), parse_args(['serve', *argv]), "
            "validate_parsed_serve_args, AsyncEngineArgs.from_cli_args (not create_engine_config: model config); "
            "VLLM_TARGET_DEVICE=cpu",
    "sglang_router": "sglang_router.launch_router.parse_router_args(argv), RouterArgs._validate_router_args()",
}
NOT_PARSED = (("vllm-router",),)  # a Rust binary: no Python parser to ask
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
PLACEHOLDER = re.compile(r"<([^<>]+)>")


@dataclass(frozen=True)
class Command:
    """One server command of one recipe, split for its engine's parser."""

    recipe: str
    key: str           # the line's key in the golden file (first 10 hex digits of its SHA-1)
    engine: str
    head: str
    argvs: tuple[tuple[str, ...], ...]   # one argument list per node


def emitted_recipes() -> tuple[str, list]:
    """The golden file's text and every recipe behind it, from the golden-file test's own enumeration."""
    sys.path.insert(0, str(ROOT / "tests" / "cookbook"))
    import test_cookbook_golden as golden

    recipes = []

    def recording(request):
        recipe = real(request)
        recipes.append(recipe)
        return recipe

    real = golden.make_recipe
    with mock.patch.object(golden, "make_recipe", recording):
        text = golden.golden_text()
    return text, recipes


def split_head(line: str) -> tuple[tuple[str, ...], list[str]]:
    """(head, arguments) of a command line, its leading VAR=value assignments dropped."""
    tokens = shlex.split(line)
    while tokens and ENV_ASSIGNMENT.fullmatch(tokens[0]):
        tokens.pop(0)
    for head in (*HEADS, *NOT_PARSED):
        if tuple(tokens[:len(head)]) == head:
            return head, tokens[len(head):]
    return tuple(tokens[:1]), tokens[1:]


def _option(argv: list[str], name: str) -> str | None:
    for index, token in enumerate(argv):
        if token == name and index + 1 < len(argv):
            return argv[index + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    return None


def node_count(argv: list[str]) -> int:
    """How many machines run this command: --nnodes, or vLLM's data-parallel size over its local part."""
    nodes = _option(argv, "--nnodes")
    if nodes is not None and nodes.isdigit():
        return int(nodes)
    size, local = _option(argv, "--data-parallel-size"), _option(argv, "--data-parallel-size-local")
    if size and local and size.isdigit() and local.isdigit() and int(local) and "<node-index" in " ".join(argv):
        return max(1, int(size) // int(local))
    return 1


def fill(line: str, node: int) -> str:
    """A command line with its placeholders filled for node `node` (node 0 is the head)."""
    def value(match: re.Match) -> str:
        name = match.group(1)
        if name == "rank":
            return str(node)
        if index := re.fullmatch(r"node-index x (\d+)", name):
            return str(node * int(index.group(1)))
        if name.endswith(("-ip", "-host")):
            return "10.0.0.1" if "head" in name else f"10.0.0.{node + 1}"
        if name.endswith("-port"):
            return "13345"
        if name == "nic":
            return "eth0"
        if name.endswith(".json"):
            return f"/etc/{name}"
        raise ValueError(f"placeholder <{name}> has no value to parse with; teach tools/check_upstream_parsers.py's "
                         f"fill() one")
    return PLACEHOLDER.sub(value, line)


def server_commands(recipes: list) -> tuple[list[Command], dict[str, int]]:
    """Every SGLang and vLLM server command of `recipes`, and a count of the lines not parsed, by head."""
    commands, skipped = [], defaultdict(int)
    for recipe in recipes:
        for engine in ("sglang", "vllm"):   # the recipe's engines; a router line belongs to its engine's recipe
            if engine not in recipe.commands:
                continue
            for line in recipe.commands[engine].lines:
                head, argv = split_head(fill(line, 0))     # placeholders first: `<node-index x 4>` holds spaces
                parser = HEADS.get(head)
                if parser is None:
                    skipped[" ".join(head)] += 1
                    continue
                nodes = node_count(split_head(line)[1])
                argvs = tuple(dict.fromkeys(tuple(split_head(fill(line, node))[1]) for node in range(nodes)))
                key = hashlib.sha1(line.encode()).hexdigest()[:10]
                commands.append(Command(recipe.id, key, parser, " ".join(head), argvs))
    return commands, dict(skipped)


def pip(*args: str, find_links: list[str]) -> None:
    links = [arg for link in find_links for arg in ("--find-links", link)]
    run = subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet",
                          "--disable-pip-version-check", *links, *args], capture_output=True, text=True)
    if run.returncode != 0:   # pip's complaints about the engines' undeclared dependencies are expected: --no-deps
        raise SystemExit(f"pip install {' '.join(args)} failed ({run.returncode}):\n{run.stderr[-4000:]}")


def ensure_venv(engines: list[str], find_links: list[str]) -> float:
    """Builds the upstream venv unless it holds exactly these pins already; the seconds its build took."""
    imports = sorted({p for e in engines for p in IMPORTS[e]})
    wanted = "\n".join([TORCH, *(ENGINES[e] for e in engines), *imports]) + "\n"
    stamp, took = VENV / "kestrel-pins.txt", VENV / "kestrel-build-seconds.txt"
    if stamp.is_file() and stamp.read_text() == wanted and took.is_file():
        return float(took.read_text())
    print(f"building {VENV.relative_to(ROOT)} (about 2 minutes)", file=sys.stderr)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    pip(TORCH, *imports, find_links=find_links)
    pip("--no-deps", *(ENGINES[e] for e in engines), find_links=find_links)
    seconds = time.perf_counter() - start
    stamp.write_text(wanted)
    took.write_text(f"{seconds:.1f}\n")
    return seconds


def parse_upstream(engine: str, argvs: list[tuple[str, str]]) -> tuple[str, list[list[dict]]]:
    """(engine version, rejections per (head, argv)) from the engine's own parser in the upstream venv."""
    with tempfile.TemporaryDirectory() as tmp:
        given, answer = Path(tmp) / "commands.json", Path(tmp) / "results.json"
        given.write_text(json.dumps([{"head": head, "argv": list(argv)} for head, argv in argvs]))
        run = subprocess.run([str(VENV / "bin" / "python"), str(CHILD), engine, str(given), str(answer)],
                             capture_output=True, text=True, cwd=tmp)
        if run.returncode != 0:
            raise SystemExit(f"{engine}'s parser did not run ({run.returncode}):\n{run.stderr[-4000:]}")
        result = json.loads(answer.read_text())
    return result["version"], [r["rejections"] for r in result["results"]]


def check(engine: str, commands: list[Command]) -> dict:
    """The record's entry for one engine: what was parsed and every rejection, by recipe."""
    ours = [c for c in commands if c.engine == engine]
    distinct = list(dict.fromkeys((c.head, argv) for c in ours for argv in c.argvs))
    start = time.perf_counter()
    version, answers = parse_upstream(engine, distinct)
    seconds = time.perf_counter() - start
    by_argv = dict(zip(distinct, answers))
    rejections = []
    for command in ours:
        seen = []
        for node, argv in enumerate(command.argvs):
            for rejection in by_argv[(command.head, argv)]:
                if rejection not in seen:
                    seen.append(rejection)
                    rejections.append({"recipe": command.recipe, "command": command.key, **rejection})
    return {"version": version, "parsed_with": PARSED_WITH[engine], "command_lines": len(ours), "recipes": len({c.recipe for c in ours}),
            "argument_lists_parsed": len(distinct), "parse_seconds": round(seconds, 1), "rejections": rejections}


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    changed = git("status", "--porcelain", "--", ".", f":!{RECORD.relative_to(ROOT)}")
    return git("rev-parse", "HEAD") + (" (with uncommitted changes)" if changed else "")


def report(record: dict) -> None:
    for engine in ENGINES:
        entry = record.get(engine)
        if not isinstance(entry, dict):
            continue
        print(f"{engine} {entry['version']}: {entry['command_lines']} command lines of {entry['recipes']} recipes, "
              f"{entry['argument_lists_parsed']} distinct argument lists parsed in {entry['parse_seconds']} s, "
              f"{len(entry['rejections'])} rejections")
        grouped = defaultdict(list)
        for r in entry["rejections"]:
            grouped[(r["flag"], r["value"], r["message"])].append(r["recipe"])
        for (flag, value, message), recipes in grouped.items():
            print(f"  {flag or '-'} {value or ''}: {message}\n    in {len(recipes)}: {', '.join(recipes)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--find-links", action="append", default=[], help="a local wheel folder for pip (torch)")
    parser.add_argument("--skip-vllm", action="store_true", help="leave vLLM's commands unchecked")
    args = parser.parse_args()
    engines = [e for e in ENGINES if not (args.skip_vllm and e == "vllm")]

    started = time.perf_counter()
    text, recipes = emitted_recipes()
    golden = ROOT / "tests" / "cookbook" / "golden" / "recipes.txt"
    if not golden.is_file() or golden.read_text() != text:
        print(f"{golden.relative_to(ROOT)} is not what the generator emits; refresh it first (.venv/bin/python "
              f"tests/cookbook/test_cookbook_golden.py), then run this again.", file=sys.stderr)
        return 2
    commands, skipped = server_commands(recipes)
    install_seconds = ensure_venv(engines, args.find_links)

    record = {
        "date": datetime.date.today().isoformat(),
        "golden_file": str(golden.relative_to(ROOT)),
        "golden_sha256": hashlib.sha256(golden.read_bytes()).hexdigest(),
        "kestrel_commit": git_commit(),
        "recipes": len(recipes),
        "how": "make check-recipes (tools/check_upstream_parsers.py, tools/upstream_parse.py)",
        "venv_build_seconds": round(install_seconds, 1),  # the upstream venv's last build, not necessarily this run's
        "lines_not_parsed": skipped,
    }
    for engine in engines:
        record[engine] = check(engine, commands)
    if args.skip_vllm:
        record["vllm"] = "not checked (--skip-vllm)"
    record["total_seconds"] = round(time.perf_counter() - started, 1)
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    report(record)
    print(f"wrote {RECORD.relative_to(ROOT)}")
    return 1 if any(isinstance(record[e], dict) and record[e]["rejections"] for e in engines) else 0


if __name__ == "__main__":
    sys.exit(main())
