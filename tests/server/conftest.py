"""Server fixtures: the tiny XTML model folder and a live server on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from server_helpers import LiveServer, write_model_folder


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("k31-xtml")
    write_model_folder(folder)
    return folder


@pytest.fixture(scope="session")
def server(model_folder):
    live = LiveServer(model_folder, page_size=4)
    yield live
    live.stop()
