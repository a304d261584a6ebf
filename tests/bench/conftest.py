"""Bench fixtures: a live kestrel server (tiny XTML model) for the client to measure."""

from __future__ import annotations

import pytest

from server_helpers import LiveServer, write_model_folder


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench-model")
    write_model_folder(folder)
    server = LiveServer(folder, page_size=4)
    yield server
    server.stop()
