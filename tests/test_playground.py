"""The playground page (``GET /playground``) in a real browser: Debian's headless Chromium driven by
Selenium loads it from ``mstar serve llama-tiny``, sends a chat, waits for the streamed answer and its
trace timeline, and saves a screenshot; a server error shows as a message. Skips, saying why, where
Chromium, its driver or Selenium is missing (``make test`` installs them where apt is)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mstar.bench.net import free_port
from mstar.models.llama.model import LlamaTiny
from tests.server_utils import running_server


@contextlib.contextmanager
def mstar_serve(model: str):
    """``mstar serve MODEL`` as a process on a free port; yields its URL."""
    root, port = Path(__file__).resolve().parent.parent, free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mstar.cli.main", "serve", model, "--port", str(port)], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "mstar serve did not come up"
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def _browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install chromium "
                    "chromium-driver; `make test` does it where apt is)")
    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def test_the_page_and_its_files_are_served_offline():
    with running_server(LlamaTiny(), "llama-tiny", api_key="secret") as (url, _):
        page = httpx.get(url + "/playground", timeout=30)  # no key needed for the page itself
        script = httpx.get(url + "/playground/playground.js", timeout=30)
        missing = httpx.get(url + "/playground/..%2Fapp.py", timeout=30)  # no way out of the folder
        other = httpx.get(url + "/playground/secrets.txt", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script src=\"/playground/playground.js\">" in page.text and "http" not in page.text.split("<body>")[1]
    assert script.status_code == 200 and "GET /v1/requests" in script.text
    assert missing.status_code == 404 and other.status_code == 404
    assert other.json()["error"]["code"] == "not_found"


def test_a_chat_in_a_real_browser_streams_its_answer_and_draws_its_trace(tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser = _browser()
    try:
        with mstar_serve("llama-tiny") as url:
            browser.get(url + "/playground")
            wait = WebDriverWait(browser, 60)
            wait.until(ec.text_to_be_present_in_element((By.ID, "model"), "llama-tiny"))
            box = browser.find_element(By.ID, "chat-input")
            box.send_keys("Hello there")
            browser.find_element(By.ID, "chat-max").clear()
            browser.find_element(By.ID, "chat-max").send_keys("12")
            browser.find_element(By.ID, "chat-send").click()
            wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".trace svg.trace-timeline"))
            answer = browser.find_element(By.CSS_SELECTOR, ".msg.assistant").text
            caption = browser.find_element(By.CSS_SELECTOR, ".trace .caption").text
            bars = browser.find_elements(By.CSS_SELECTOR, ".trace svg rect")
            browser.save_screenshot(str(tmp_path / "chat.png"))
            # a server error is shown as a message: more tokens than the model's context
            browser.find_element(By.ID, "chat-max").clear()
            browser.find_element(By.ID, "chat-max").send_keys("4096")
            browser.find_element(By.ID, "chat-input").send_keys("again")
            browser.find_element(By.ID, "chat-send").click()
            wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".msg.error"))
            error = browser.find_element(By.CSS_SELECTOR, ".msg.error").text
    finally:
        browser.quit()
    assert answer.strip()  # the streamed text
    assert "finished" in caption and "walk(s)" in caption and len(bars) >= 3  # walk bands and node runs
    assert (tmp_path / "chat.png").stat().st_size > 10_000
    assert error.startswith("400") and "max_tokens (4096)" in error, error
