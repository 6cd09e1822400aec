"""The README's screenshots of the playground and the dashboard, with a real model answering.

    python tools/web_screenshots.py                  # SmolLM2 (pulled once), into docs/images/
    python tools/web_screenshots.py --model gemma3-270m --out /tmp/shots

Starts `pagoda serve` on the model, asks the playground a question in headless Chromium (Debian's
chromium and chromium-driver), waits for the answer, then puts a few streams of load on the
server and takes the dashboard while it moves. tests/entrypoints/web/test_browser.py checks the
pages' behaviour; this only takes pictures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from server_process import background_load, start_server, stop_process  # noqa: E402

QUESTION = "What is the capital of France? Answer in one sentence."
LOAD_PROMPTS = ["Write a short poem about the sea.", "List three fruits.", "Explain what a CPU does.",
                "Tell me a fun fact about cats."]


def _wait(driver, condition, timeout: float = 120):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(d))


def _browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path="/usr/bin/chromedriver"))


def playground(driver, base: str, out: Path) -> None:
    driver.get(f"{base}/")
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
    temperature = driver.find_element(By.ID, "temperature")
    temperature.clear()
    temperature.send_keys("0")
    driver.find_element(By.ID, "prompt").send_keys(QUESTION + Keys.ENTER)
    answer = _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1])
    _wait(driver, lambda d: answer.get_attribute("data-done") == "finished")
    driver.save_screenshot(str(out / "playground.png"))
    print("playground:", answer.find_element(By.CLASS_NAME, "content").text[:200])


def dashboard(driver, base: str, model: str, out: Path) -> None:
    bodies = [{"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": 96} for p in LOAD_PROMPTS]
    with background_load(base, "/v1/chat/completions", bodies):
        driver.get(f"{base}/dashboard")
        steps = _wait(driver, lambda d: d.find_element(By.ID, "num-steps"))
        _wait(driver, lambda d: steps.text.isdigit() and int(steps.text) > 150)
        _wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#requests tr")) > 6)
        driver.save_screenshot(str(out / "dashboard.png"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a catalog name or a model path")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    proc, base = start_server(args.model, "--kv-cache-memory", "0.5", name=None)
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    driver = _browser()
    try:
        playground(driver, base, args.out)
        dashboard(driver, base, model, args.out)
    finally:
        driver.quit()
        stop_process(proc)
    print(f"screenshots in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
