#!/bin/sh
# Fuzz the server with fresh randomness (make test runs the same 150 examples every time):
#   sh tools/fuzz.sh [EXAMPLES]     (default 3000; about 1 s per 10 examples on 2 cores)
# Any failure it finds is a bug to fix and an @example to add to tests/server/test_robustness.py.
cd "$(dirname "$0")/.." && KESTREL_FUZZ_EXAMPLES="${1:-3000}" exec .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/server/test_robustness.py -k fuzzed --hypothesis-profile random --hypothesis-show-statistics
