"""Bench fixtures: a live kestrel server (tiny XTML model) for the client to measure, and the folder it serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from server_helpers import LiveServer, write_model_folder


@pytest.fixture(scope="module")
def bench_model_folder(tmp_path_factory) -> Path:
    """The served model's folder, so tests can recompute what the server answers without going through it."""
    folder = tmp_path_factory.mktemp("bench-model")
    write_model_folder(folder)
    return folder


@pytest.fixture(scope="module")
def live(bench_model_folder):
    server = LiveServer(bench_model_folder, page_size=4)
    yield server
    server.stop()
