"""A screenshot of the dashboard after a question, as docs/dashboard.png shows it.

    OUT=/tmp/demo scripts/demo.sh --dashboard &      # the demo's stream, node and dashboard
    .venv/bin/python scripts/dashboard_screenshot.py "What color was the triangle?" \
        docs/dashboard.png

Headless Chromium (Debian's chromium and chromium-driver, which scripts/setup.sh installs)
opens the page, asks the question in the ask box and saves the page once the answer's evidence
is lit on the timeline.
"""

from __future__ import annotations

import argparse
import shutil

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question")
    parser.add_argument("out", help="PNG file to write")
    parser.add_argument("--url", default="http://127.0.0.1:8080/")
    parser.add_argument("--size", default="1200,1250", help="window width,height in pixels")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per wait")
    args = parser.parse_args()
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu",
                f"--window-size={args.size}"):
        options.add_argument(arg)
    browser = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        browser.get(args.url)
        wait = WebDriverWait(browser, args.timeout)
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#timeline rect.bar")))
        wait.until(lambda b: b.execute_script(
            "const i = document.getElementById('strip');"
            "return i !== null && i.complete && i.naturalWidth > 0;"))
        browser.find_element(By.ID, "question").send_keys(args.question)
        browser.find_element(By.ID, "ask").click()
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#evidence.has-evidence")))
        browser.save_screenshot(args.out)
    finally:
        browser.quit()


if __name__ == "__main__":
    main()
