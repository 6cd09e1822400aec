"""The playground's image attachment in a real browser (headless Chromium through Selenium, as
test_browser.py): an image attached beside a message goes to the tiny Gemma 3 vision model as an
image_url part, shows with the turn, and its tokens count in the answer's prompt tokens (the
processor's count, image tokens included); a broken image file is the server's 400 in the page."""

from __future__ import annotations

from pathlib import Path

import pytest
from browser_session import chromium
from server_process import start_server, stop_process
from vision_models import chat_text, make_tiny_gemma3_vision, random_image

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

TEXT = "What is in the picture?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_gemma3_vision(tmp_path_factory.mktemp("playground-vision") / "m", seed=9)


@pytest.fixture(scope="module")
def server(model_dir):
    proc, base = start_server(model_dir)
    yield base
    stop_process(proc)


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


def _wait(driver, condition, timeout: float = 30):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))


def _send(browser, text: str, image: Path) -> None:
    browser.find_element(By.ID, "image").send_keys(str(image))
    assert browser.find_element(By.ID, "attached").text == image.name
    browser.find_element(By.ID, "prompt").send_keys(text)
    browser.find_element(By.ID, "send").click()


def test_an_attached_image_goes_with_the_message(server, browser, model_dir, tmp_path):
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    image = random_image(31, (60, 40))
    path = tmp_path / "picture.png"
    image.save(path)
    prompt = chat_text(processor, [{"type": "text", "text": TEXT}, {"type": "image"}])
    want = len(processor(text=prompt, images=[image])["input_ids"][0])
    browser.get(server)
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
    browser.find_element(By.ID, "max_tokens").clear()
    browser.find_element(By.ID, "max_tokens").send_keys("4")
    _send(browser, TEXT, path)
    answer = _wait(browser, lambda d: [b for b in d.find_elements(By.CSS_SELECTOR, ".message.assistant")
                                       if b.get_attribute("data-done")])[0]
    assert browser.find_element(By.CSS_SELECTOR, ".message.user img.attached-image").get_attribute("src") \
        .startswith("data:image/png;base64,")
    assert answer.find_element(By.CSS_SELECTOR, ".figure-prompt").text == f"{want} prompt tokens"
    assert browser.find_element(By.ID, "attached").text == ""  # the attachment went with that turn

    broken = tmp_path / "broken.png"
    broken.write_bytes(path.read_bytes()[:100])
    _send(browser, TEXT, broken)
    error = _wait(browser, lambda d: d.find_element(By.ID, "error").text)
    assert "corrupt" in error and "image_url" in error
