"""The live dashboard of `tokenflow serve`, loaded in headless Chromium (Debian's `chromium`, driven by
Playwright without a browser download): behind the API key, it shows a burst of requests as it happens
(requests running, the KV map filling, then cached blocks, times to first token, the errors callers got)
with no console errors."""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest

from tests.servers import ServeProcess

KEY = "dashboard-test-key"
BEARER = {"Authorization": f"Bearer {KEY}"}


def _until(page, expression: str, timeout_s: float) -> None:
    """Poll `expression` in the page from here: the page's CSP forbids the eval Playwright's own waiting uses."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"the page never showed: {expression}"
        time.sleep(0.1)


def _burst(url: str, stop: threading.Event, done: list[int]) -> None:
    """Requests over 4 connections until `stop` (at least 24, so the load outlasts the page's polls however
    fast the host), and two a caller gets wrong (errors for the page to list)."""
    def connection(k: int) -> None:
        i = k
        while i < 24 or not stop.is_set():
            body = {"model": "tiny-llama", "prompt": f"request {i} " * 20, "max_tokens": 160, "ignore_eos": True}
            httpx.post(url + "/v1/completions", json=body, headers=BEARER, timeout=120).raise_for_status()
            done.append(i)
            i += 4

    for bad in ({"prompt": "x", "max_tokens": -1}, {"prompt": "x", "temperature": "hot"}):
        assert httpx.post(url + "/v1/completions", json=bad, headers=BEARER, timeout=30).status_code == 400
    threads = [threading.Thread(target=connection, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_dashboard_shows_a_burst_live_in_chromium(tiny_model, tmp_path) -> None:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "the dashboard test needs Debian's chromium (scripts/install.sh --dev installs it)"
    with ServeProcess(tiny_model, "--api-key", KEY, "--set", "max_num_seqs=4") as server:
        refused = httpx.get(server.url + "/dashboard", timeout=30)
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
        assert httpx.get(server.url + "/v1/engine/stats", timeout=30).status_code == 401
        snapshot = httpx.get(server.url + "/v1/engine/stats", headers=BEARER, timeout=30).json()
        assert snapshot["stats"]["kv_blocks_total"] > 0 and len(snapshot["step_ms"]["counts"]) == 12

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            context = browser.new_context(http_credentials={"username": "ops", "password": KEY},
                                          viewport={"width": 1280, "height": 900})
            page = context.new_page()
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(server.url + "/dashboard")
            _until(page, "document.getElementById('finished').textContent === '0'", 15)
            assert page.locator("#kv-map div").count() == 256 and page.locator("#kv-map .used").count() == 0

            done: list[int] = []
            stop = threading.Event()
            burst = threading.Thread(target=_burst, args=(server.url, stop, done))
            burst.start()
            # under load: requests running and KV blocks in use, as the page polls
            _until(page, "Number(document.getElementById('running').textContent) > 0", 30)
            _until(page, "document.querySelectorAll('#kv-map .used').length > 0", 30)
            shot = os.environ.get("DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png")
            page.screenshot(path=shot, full_page=True)
            stop.set()
            burst.join()
            finished = len(done)
            assert finished >= 24 and len(set(done)) == finished
            # after it: everyone finished, the prompts' blocks cached, the distributions and errors filled in
            _until(page, f"document.getElementById('finished').textContent === '{finished}'", 15)
            _until(page, "document.querySelectorAll('#kv-map .used').length === 0", 15)
            assert page.locator("#kv-map .cached").count() > 0
            ttft = sum(int(b.get_attribute("data-count")) for b in page.locator("#ttft-hist rect").all())
            steps = sum(int(b.get_attribute("data-count")) for b in page.locator("#step-hist rect").all())
            assert ttft == finished and steps > 100
            assert "InvalidRequest: 2" in page.text_content("#error-counts")
            assert page.locator("#errors tr").count() == 2
            assert page.text_content("#breaker-state") == "closed"
            assert "not updated" not in page.text_content("#updated")
            browser.close()
    assert problems == [], problems


@pytest.mark.parametrize("header", ["Basic bm90IGJhc2U2NA", "Basic " + "b3BzOndyb25n", "Token abc", ""])
def test_dashboard_refuses_a_wrong_key(tiny_model, header) -> None:
    from tests.servers import Server

    with Server(tiny_model, api_key=KEY) as server:
        for route in ("/dashboard", "/v1/engine/stats"):
            response = httpx.get(server.url + route, headers={"Authorization": header} if header else {}, timeout=30)
            assert response.status_code == 401, (route, header)
        ok = httpx.get(server.url + "/dashboard", auth=("anyone", KEY), timeout=30)
        assert ok.status_code == 200 and "<title>tokenflow dashboard</title>" in ok.text
        assert "default-src 'none'" in ok.headers["content-security-policy"]
