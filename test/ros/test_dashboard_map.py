"""The dashboard page's map and health tiles in headless chromium, against the HTTP side alone
(no ROS): a DashboardState fed by hand as the dashboard node feeds it, so each case (no poses,
two frames, a thumbnail cut from the memory image, an evicted chunk, chunks in the second tier
and one a question recalled) is set up exactly and the page is checked within bounded waits,
whatever the machine's load."""

from __future__ import annotations

import math
import re
import urllib.request
from pathlib import Path

import cv2
import numpy as np
import pytest
from dashboard_helpers import chromium

from deltas_ros.ros.dashboard_http import DashboardHttp
from deltas_ros.ros.dashboard_state import DashboardState
from deltas_ros.runtime.image import GAP, LABEL_H, THUMB_H, THUMB_W, MemoryImage

MAP_JS = Path(__file__).resolve().parents[2] / "deltas_ros" / "ros" / "dashboard_map.js"
STAMP0 = 1_700_000_000.0
TIP = "return document.getElementById('maptip').textContent"
WAIT_S = 60  # every wait's bound: generous on a loaded machine, never forever


def pose(i: int, frame: str = "odom") -> dict:
    """Chunk i's pose: around an ellipse, heading along it."""
    angle = i / 6
    half = (angle + math.pi / 2) / 2
    return {"frame_id": frame, "x": 2.0 * math.cos(angle), "y": 1.2 * math.sin(angle),
            "z": 0.0, "qx": 0.0, "qy": 0.0, "qz": math.sin(half), "qw": math.cos(half)}


def chunk(i: int, with_pose: dict | None) -> dict:
    return {"index": i, "stream_time": float(i), "stamp": STAMP0 + i, "drift": 0.1 + i % 3 / 10,
            "chunk_tokens": 14, "kv_tokens": 14 * (i + 1), "evicted_tokens": 0,
            "pose": with_pose}


def strip_jpeg(times: list[float]) -> bytes:
    """The node's memory image of these held chunks (a distinct colour per tile), as JPEG."""
    strip = MemoryImage(max(2, len(times)))
    for i, t in enumerate(times):
        strip.add(i, t, 0.1, np.full((48, 64, 3), (40 * i % 256, 120, 200), np.uint8))
    ok, data = cv2.imencode(".jpg", strip.render()[:, :, ::-1])
    assert ok
    return data.tobytes()


HEALTH = {"level": 0, "message": "ok", "values": {
    "lifecycle": "active", "camera_publishers": "1", "input_rate_hz": "30.0",
    "kv_tokens": "140", "budget_tokens": "8192", "chunks_dropped": "0",
    "questions_answered": "1", "questions_failed": "1"}}


def fake_ask(question, on_feedback, left) -> dict:
    """An answer whose evidence is chunk 9 (posed) and chunk 20, which the page never saw, and
    which recalled chunk 4 from disk."""
    on_feedback({"answer": "a blue", "tokens": 2, "recalled_chunks": 1,
                 "recalled_from_disk": 1})
    return {"success": True, "answer": "a blue square", "evidence_times": [9.0, 20.0],
            "evidence_poses": [pose(9), pose(20)], "recalled_chunks": 1,
            "recalled_from_disk": 1, "recalled_times": [4.0]}


@pytest.fixture
def page():
    """The server with three chunks without poses (a node without pose_topic), and a browser
    on its page."""
    state = DashboardState()
    for i in range(3):
        state.add_chunk(chunk(i, None))
    state.set_health(HEALTH)
    server = DashboardHttp(state, "127.0.0.1", 0, ask=fake_ask, cancel=lambda: True)
    port = server.start()
    browser = chromium()
    try:
        browser.get(f"http://127.0.0.1:{port}/")
        yield state, browser
    finally:
        browser.quit()
        server.stop()


def test_the_map_knows_the_memory_image_tiles():
    """The page cuts a chunk's picture out of the memory image by runtime/image.py's layout."""
    found = re.search(r"TILE_W = (\d+), TILE_H = (\d+) \+ (\d+), TILE_GAP = (\d+);",
                      MAP_JS.read_text())
    assert found and tuple(map(int, found.groups())) == (THUMB_W, THUMB_H, LABEL_H, GAP)


def test_the_page_comes_whole_and_the_image_with_its_stamp():
    """The page's scripts are inlined (a script URL would need the token); /memory.jpg says
    after which chunk it was drawn, spelled as /state's held stamp."""
    state = DashboardState()
    state.set_image(strip_jpeg([0.0, 1.0]), STAMP0 + 1.25)
    server = DashboardHttp(state, "127.0.0.1", 0, token="t")
    url = f"http://127.0.0.1:{server.start()}"
    try:
        with urllib.request.urlopen(f"{url}/?token=t", timeout=10) as response:
            page = response.read().decode()
        with urllib.request.urlopen(f"{url}/memory.jpg?token=t", timeout=10) as response:
            stamp = response.headers["X-Memory-Stamp"]
    finally:
        server.stop()
    assert "<script src=" not in page
    assert all(name in page for name in ("function drawMap", "function healthTiles",
                                         "new EventSource"))
    assert float(stamp) == STAMP0 + 1.25


@pytest.mark.slow
def test_the_map_and_tiles_in_headless_chromium(page):
    state, browser = page
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, WAIT_S)
    text = lambda css: browser.find_element(By.CSS_SELECTOR, css).text  # noqa: E731
    points = lambda: browser.find_elements(By.CSS_SELECTOR, "#map .pt")  # noqa: E731

    # No chunk has a pose: the map is empty and says why. The tiles read the diagnostics.
    wait.until(lambda b: "No poses" in text("#map-note.empty"))
    assert "pose_topic" in text("#map-note") and not points()
    wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#tiles .tile")) == 4)
    levels = {t.get_attribute("data-name"): t.get_attribute("class").split()[-1]
              for t in browser.find_elements(By.CSS_SELECTOR, "#tiles .tile")}
    assert levels == {"Node": "ok", "Camera": "ok", "Memory": "ok", "Questions": "warn"}
    assert "1 failed" in text('#tiles .tile[data-name="Questions"]')
    assert "140 of 8192 tokens" in text('#tiles .tile[data-name="Memory"]')
    assert not browser.find_element(By.ID, "health").is_displayed()  # folded away

    # Posed chunks arrive live: one in "map", then ten in "odom"; the map shows the newest
    # frame's and says there are two. Chunks 4 and 6 were evicted into the second tier, on
    # disk and in host memory, and chunk 8 thinned into it; the memory image has a tile for
    # each held chunk, drawn after the same chunk as the held list.
    state.add_chunk(chunk(3, pose(3, "map")))
    for i in range(4, 14):
        state.add_chunk(chunk(i, pose(i)))
    times = [float(i) for i in range(14) if i not in (4, 6)]
    state.set_held({"stream_time": times, "tokens": [14] * len(times),
                    "bucket": [k // 4 for k in range(len(times))], "stamp": STAMP0 + 13,
                    "tiered_time": [4.0, 6.0, 8.0], "tiered_tokens": [14, 14, 6],
                    "tiered_tier": ["disk", "host", "host"]})
    state.set_image(strip_jpeg(times), STAMP0 + 13)
    wait.until(lambda b: len(points()) == 10)
    assert "2 frames (map, odom)" in text("#map-note")
    assert "showing the newest frame's, odom" in text("#map-note")
    wait.until(lambda b: b.execute_script(
        "const i = document.getElementById('strip'); return i.complete && i.naturalWidth > 0"))
    bar = lambda kind, i: browser.find_elements(  # noqa: E731
        By.CSS_SELECTOR, f'#timeline rect.bar{kind}[data-index="{i}"]')
    assert bar(".disk", 4) and bar(".host", 6) and not bar(".host", 8)  # 8 is still held
    assert browser.find_elements(By.CSS_SELECTOR, '#map .pt.disk[data-t="4"]')
    assert browser.find_elements(By.CSS_SELECTOR, '#map .pt.host[data-t="6"]')
    tip = browser.execute_script(
        "return document.querySelector('#timeline rect.bar[data-index=\"8\"] title')"
        ".textContent")
    assert "14 tokens held; 6 tokens in host memory" in tip, tip

    def hover(t: float) -> str:
        dot = browser.find_element(By.CSS_SELECTOR, f'#map .pt[data-t="{t:g}"]')
        ActionChains(browser).move_to_element(dot).perform()
        wait.until(lambda b: f"t={t:.2f} s" in b.execute_script(TIP))
        return browser.execute_script(TIP)

    # Hover: the time, and the chunk's tile as its picture (a canvas); an evicted chunk says
    # why it has none.
    assert "chunk 9" in hover(9.0)
    assert browser.find_elements(By.CSS_SELECTOR, "#maptip canvas")
    on_disk = hover(4.0)
    assert "no picture: evicted" in on_disk and "14 tokens on disk" in on_disk

    # Click: the question's window around the chunk, as a click on the timeline sets it.
    browser.find_element(By.CSS_SELECTOR, '#map .pt[data-t="11"]').click()
    since = float(browser.find_element(By.ID, "since").get_attribute("value"))
    until = float(browser.find_element(By.ID, "until").get_attribute("value"))
    assert since <= 11.0 <= until and until - since <= 0.2, (since, until)
    assert browser.find_elements(By.CSS_SELECTOR, '#map .pt.inwin[data-t="11"]')

    # An answer lights its evidence: chunk 9's point, and a mark for chunk 20, unseen; and the
    # chunk it recalled, 4, on the timeline and the map, while 6 stays in its tier.
    browser.find_element(By.ID, "question").send_keys("What was blue?")
    browser.find_element(By.ID, "ask").click()
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, '#map circle.pt.evidence[data-t="9"]'))
    assert browser.find_elements(By.CSS_SELECTOR, '#map rect.pt.evidence[data-t="20"]')
    assert browser.find_elements(By.CSS_SELECTOR, "#timeline rect.bar.evidence")
    assert bar(".recalled", 4) and bar(".host", 6)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#timeline rect.bar.recalled")) == 1
    assert browser.find_elements(By.CSS_SELECTOR, '#map .pt.recalled[data-t="4"]')
    assert text("#recalled") == "recalled 1 chunk from the second tier (1 from disk) at 4.0 s"
