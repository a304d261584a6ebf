"""Compile recorded Triton kernel launches for the H200 (sm_90) in a process of its own, no GPU needed.

Reads a JSON list of launches from stdin, each {"module", "kernel", "signature", "constexprs", "options"}, and
prints a JSON list with {"shared": bytes} or {"error": message} per launch. It runs apart from the test process
because the interpreter (TRITON_INTERPRET=1) decorates and patches triton.language for itself; here the kernels
are decorated for compilation.
"""

import importlib
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H200 = GPUTarget("cuda", 90, 32)


def compile_launch(launch: dict) -> dict:
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    try:
        source = ASTSource(kernel, launch["signature"], launch["constexprs"])
        compiled = triton.compile(source, target=H200, options=launch["options"])
    except Exception as error:                       # noqa: BLE001 - reported to the test, which fails on it
        return {"error": f"{type(error).__name__}: {error}"}
    return {"shared": compiled.metadata.shared}


if __name__ == "__main__":
    print(json.dumps([compile_launch(launch) for launch in json.load(sys.stdin)]))
