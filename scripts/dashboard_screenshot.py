"""A screenshot of the dashboard after a question, as docs/dashboard.png shows it, and its map.

    OUT=/tmp/demo scripts/demo.sh --dashboard &      # the demo's stream, node and dashboard
    .venv/bin/python scripts/dashboard_screenshot.py "What color was the triangle?" \
        docs/dashboard.png --map-out docs/dashboard_map.png

Headless Chromium (Debian's chromium and chromium-driver, which scripts/setup.sh installs)
opens the page, asks the question in the ask box and, once the answer's evidence is lit on the
timeline and the map, hovers the last evidence point on the map (its picture and time) and
saves the page; --map-out also saves the map with that hover alone.
"""

from __future__ import annotations

import argparse
import shutil

import cv2
import numpy as np
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question")
    parser.add_argument("out", help="PNG file to write")
    parser.add_argument("--map-out", help="PNG file for the map section alone")
    parser.add_argument("--url", default="http://127.0.0.1:8080/")
    parser.add_argument("--size", default="1200,900", help="window width,height in pixels")
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
        lit = browser.find_elements(By.CSS_SELECTOR, "#map .pt.evidence")
        if lit:
            ActionChains(browser).move_to_element(lit[-1]).perform()
            wait.until(lambda b: b.find_element(By.ID, "maptip").is_displayed())
        browser.save_screenshot(args.out)
        if args.map_out:
            save_map(browser, args.out, args.map_out)
    finally:
        browser.quit()


def save_map(browser: webdriver.Chrome, page_png: str, out: str) -> None:
    """The map's section and its hover box, cut out of the page's screenshot."""
    box = browser.execute_script(
        "const r = [document.getElementById('map').closest('section'),"
        "           document.getElementById('maptip')]"
        "  .filter((e) => getComputedStyle(e).display !== 'none')"
        "  .map((e) => e.getBoundingClientRect());"
        "return [Math.min(...r.map((b) => b.left)), Math.min(...r.map((b) => b.top)),"
        "        Math.max(...r.map((b) => b.right)), Math.max(...r.map((b) => b.bottom)),"
        "        window.devicePixelRatio];")
    left, top, right, bottom = (int(round(v * box[4])) for v in box[:4])
    page = cv2.imdecode(np.fromfile(page_png, np.uint8), cv2.IMREAD_COLOR)
    cv2.imwrite(out, page[max(top - 4, 0):bottom + 4, max(left - 4, 0):right + 4])


if __name__ == "__main__":
    main()
