"""The cookbook page in a real headless browser (Debian's chromium driven by selenium; install both with
tools/install_browser.sh), served from a local static server: picking options updates commands and numbers."""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import threading

import pytest

from kestrel.cookbook.ledger import ledger_rows
from kestrel.cookbook.matrix import matrix_rows
from kestrel.cookbook.evidence import load_records
from kestrel.cookbook.recipes import RecipeRequest, make_recipe
from kestrel.cookbook.web import build_site, site_files

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def page_url(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    build_site(site)
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/index.html"
    server.shutdown()
    thread.join()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    try:
        from selenium import webdriver
    except ImportError:
        pytest.fail("selenium is not installed: install the test dependencies (pip install -e .[test])")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.fail("Debian's chromium and chromium-driver are not installed: run tools/install_browser.sh")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    session = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    yield session
    session.quit()


@pytest.fixture
def page(browser, page_url):
    browser.get(page_url)
    return browser


def text(browser, element_id: str) -> str:
    from selenium.webdriver.common.by import By
    return browser.find_element(By.ID, element_id).text


def pick(browser, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    Select(browser.find_element(By.ID, element_id)).select_by_value(value)


def expected(recipe_id: str, length: int = 11264):
    return make_recipe(RecipeRequest.from_id(recipe_id, length))


def test_default_choice_shows_the_b300_low_latency_recipe(page):
    recipe = expected("k3/b300/unified/low-latency")
    assert text(page, "recipe-id") == recipe.id
    assert text(page, "cmd-sglang") == recipe.commands["sglang"].lines[0]
    assert text(page, "image-sglang") == "Image: lmsysorg/sglang:kimi-k3"
    assert text(page, "ratio") == "0.9"
    assert text(page, "admitted") == f"{recipe.plan.admitted_requests:,}"
    assert recipe.commands["kestrel"].lines[1] in text(page, "cmd-kestrel")
    assert text(page, "roofline-caption") == "memory reads and collectives: upper bounds"          # the plan fits


def test_picking_options_updates_the_command_and_the_numbers(page):
    pick(page, "strategy", "balanced")
    balanced = expected("k3/b300/unified/balanced")
    assert "--dcp-size 8" in text(page, "cmd-sglang")
    assert text(page, "cmd-sglang") == balanced.commands["sglang"].lines[0]
    assert text(page, "ratio") == "7.21"
    assert text(page, "kv-tokens") == f"{balanced.plan.pools.kv_tokens:,}"
    pick(page, "length", "131072")
    longer = expected("k3/b300/unified/balanced", 131072)
    assert text(page, "ratio") == longer.ratio_text != "7.21"
    assert text(page, "cmd-sglang") == longer.commands["sglang"].lines[0]
    assert text(page, "admitted") == f"{longer.plan.admitted_requests:,}"
    pick(page, "spec", "mtp")
    assert "--speculative-algorithm DSPARK" in text(page, "cmd-sglang")
    assert text(page, "slots") == "S = 5, D = 0"


def test_refused_combinations_say_why(page):
    pick(page, "hardware", "h200")
    pick(page, "spec", "dflash")
    assert "K3 DFLASH has not been validated on this hardware" in text(page, "refusal")
    assert text(page, "recipe-id") == ""                                  # hidden
    pick(page, "spec", "none")
    assert text(page, "refusal") == "" and text(page, "recipe-id") == "k3/h200/unified/low-latency"


def test_matrix_and_ledger_tables(page):
    from selenium.webdriver.common.by import By
    records = load_records()
    matrix = page.find_elements(By.CSS_SELECTOR, "#matrix-table tbody tr")
    ledger = page.find_elements(By.CSS_SELECTOR, "#ledger-table tbody tr")
    assert len(matrix) == len(matrix_rows(records))
    assert len(ledger) == len(ledger_rows(records))
    statuses = [row.find_elements(By.TAG_NAME, "td")[3].text for row in ledger]
    assert statuses == [r.status for r in ledger_rows(records)]


def test_no_external_resources(page, page_url):
    origin = page_url.rsplit("/", 1)[0]
    loaded = page.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(url.startswith(origin) for url in loaded)
    files = site_files()
    assert {name: kind.split(";")[0] for name, (_, kind) in files.items()} == {
        "index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css", "data.js": "text/javascript"}
    for name, (content, _) in files.items():
        if name != "data.js":
            assert not re.search(rb"(src|href)=\"(https?:)?//", content), name
