"""Headless Chromium through Selenium for the web pages' tests (tests/entrypoints/web/): Chromium
and chromedriver come from the Debian packages (.ci/run installs them); without them the tests
that use a browser are skipped."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def chromium() -> Iterator:
    """A headless Chromium driver, quit afterwards (a fixture's body: ``yield from chromium()``)."""
    webdriver = pytest.importorskip("selenium.webdriver")
    if not Path(CHROMEDRIVER).exists():
        pytest.skip("chromedriver is not installed (apt-get install chromium chromium-driver; .ci/run does)")
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()
