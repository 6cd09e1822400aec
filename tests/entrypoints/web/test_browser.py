"""The playground (/) and the dashboard (/dashboard) in a real browser: headless Chromium driven
by Selenium, against one real `pagoda serve --api-key` on the tiny model (a 16k context, so an
answer streams long enough to watch it grow and stop it).

Chromium and chromedriver come from the Debian packages (.ci/run installs them); without them
these tests are skipped. Screenshots of both pages land in the test's temporary directory, and
also in $PAGODA_WEB_SCREENSHOTS when it is set (the README's pictures, with SmolLM2 answering,
come from tools/web_screenshots.py instead).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
from browser_session import chromium
from server_process import background_load, start_server, stop_process

from pagoda.bench.servers import scrape_metrics

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

API_KEY = "browser-test-key"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(long_tiny_llama):
    proc, base = start_server(long_tiny_llama, "--api-key", API_KEY, "--max-model-len", "16384",
                              "--kv-cache-memory", "0.05")
    yield base
    stop_process(proc)


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory):
    out = tmp_path_factory.mktemp("screenshots")
    extra = os.environ.get("PAGODA_WEB_SCREENSHOTS")

    def save(driver, name: str) -> Path:
        path = out / name
        assert driver.save_screenshot(str(path)), name
        if extra:
            shutil.copy(path, Path(extra) / name)
        return path

    return save


def _wait(driver, condition, timeout: float = 30):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))


def _answers(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")


def _set(driver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _open_playground(driver, base: str) -> None:
    """Load / and give the key the page asks for (a fresh page has none)."""
    driver.get(f"{base}/")
    driver.execute_script("localStorage.clear()")
    driver.refresh()
    form = _wait(driver, lambda d: d.find_element(By.ID, "key-form"))
    _wait(driver, lambda d: form.is_displayed())
    assert "API key" in driver.find_element(By.ID, "key-reason").text
    driver.find_element(By.ID, "key-input").send_keys(API_KEY + Keys.ENTER)
    _wait(driver, lambda d: [o.text for o in Select(d.find_element(By.ID, "model")).options] == ["tiny"])


def test_streamed_answer_grows_and_stop_aborts_it_on_the_server(browser, server):
    _open_playground(browser, server)
    _set(browser, "max_tokens", "12000")
    _set(browser, "temperature", "0")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("Tell me a long story" + Keys.SHIFT + Keys.ENTER + Keys.NULL + "about Paris")  # NULL: Shift up
    assert prompt.get_attribute("value") == "Tell me a long story\nabout Paris" and not _answers(browser)
    before = scrape_metrics(server)
    prompt.send_keys(Keys.ENTER)  # Enter sends
    answer = _wait(browser, lambda d: _answers(d) and _answers(d)[-1])
    lengths = []  # the rendered text, as the page shows it while tokens arrive
    while len(set(lengths)) < 5:
        chars = int(answer.get_attribute("data-chars") or 0)
        if not lengths or chars != lengths[-1]:
            lengths.append(chars)
        assert answer.get_attribute("data-done") is None, "the answer ended before it was seen growing"
    assert lengths == sorted(lengths) and lengths[-1] > lengths[1] > 0
    assert scrape_metrics(server)["pagoda:num_requests_running"] == 1

    browser.find_element(By.ID, "stop").click()
    _wait(browser, lambda d: answer.get_attribute("data-done") == "stopped")
    assert "stopped" in answer.find_element(By.CLASS_NAME, "figures").text
    deadline = time.monotonic() + 30
    while True:  # the server notices the closed stream and aborts the request
        after = scrape_metrics(server)
        aborted = after.get("pagoda:request_success_total:abort", 0) - before.get("pagoda:request_success_total:abort", 0)
        if after["pagoda:num_requests_running"] == 0 and aborted == 1:
            break
        assert time.monotonic() < deadline, after
    generated = after["pagoda:generation_tokens_total"] - before.get("pagoda:generation_tokens_total", 0)
    assert 0 < generated < 12000


def test_json_schema_constraint_gives_valid_json_and_figures(browser, server, screenshots):
    Select(browser.find_element(By.ID, "constraint-kind")).select_by_value("json_schema")
    _set(browser, "constraint", json.dumps(SCHEMA))
    _set(browser, "max_tokens", "64")
    browser.find_element(By.ID, "prompt").send_keys("Is Paris in France? Answer in JSON." + Keys.ENTER)
    answer = _wait(browser, lambda d: len(_answers(d)) == 2 and _answers(d)[-1])
    _wait(browser, lambda d: answer.get_attribute("data-done") == "finished")
    value = json.loads(answer.find_element(By.CSS_SELECTOR, ".content code").text)
    jsonschema.validate(value, SCHEMA)
    figures = answer.find_element(By.CLASS_NAME, "figures")
    assert figures.find_element(By.CLASS_NAME, "figure-ttft").text.startswith("TTFT ")
    assert figures.find_element(By.CLASS_NAME, "figure-finish").text == "stop"
    # the second turn sends the first again: its prompt starts with cached blocks
    assert int(figures.find_element(By.CLASS_NAME, "figure-cached").text.split()[0]) >= 16
    screenshots(browser, "playground.png")


def test_dashboard_figures_move_under_load(browser, server, screenshots):
    browser.get(f"{server}/dashboard")  # the key is in the page's storage already
    steps = _wait(browser, lambda d: d.find_element(By.ID, "num-steps"))
    _wait(browser, lambda d: steps.text.isdigit())
    idle_steps = int(steps.text)

    bodies = [{"model": "tiny", "prompt": f"Story {i}: once upon a time", "max_tokens": 200} for i in range(4)]
    with background_load(server, "/v1/completions", bodies, headers={"Authorization": f"Bearer {API_KEY}"}):
        _wait(browser, lambda d: int(steps.text) > idle_steps + 50)
        gen_tps = browser.find_element(By.ID, "gen-tps")
        _wait(browser, lambda d: gen_tps.text not in ("–", "0.0"))  # a whole second of load in the window
        assert float(gen_tps.text) > 0
        _wait(browser, lambda d: "Story" in d.find_element(By.ID, "radix").text)  # the prompts' cached blocks
        rows = browser.find_elements(By.CSS_SELECTOR, "#requests tr")
        assert len(rows) > 4 and browser.find_elements(By.CSS_SELECTOR, "#requests .timeline .decode")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#steps tr")) > 10
        screenshots(browser, "dashboard.png")


def test_api_docs_render_offline(browser, server):
    """/docs is Swagger UI from the server's own vendored copy: this machine has no internet, so a
    page that loaded its script from a CDN (FastAPI's default) stays blank here."""
    html = httpx.get(f"{server}/docs", timeout=30).text
    assert "cdn" not in html.lower() and "https://" not in html, html
    browser.get(f"{server}/docs")
    title = _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".swagger-ui .info .title"))
    assert "pagoda" in title.text
    _wait(browser, lambda d: "/v1/chat/completions" in d.find_element(By.CSS_SELECTOR, ".swagger-ui").text)
    assert httpx.get(f"{server}/docs/swagger-ui.css", timeout=30).status_code == 200  # open, like /docs
    assert httpx.get(f"{server}/docs/LICENSE", timeout=30).status_code == 404  # only the two assets
