"""The live dashboard of `tokenflow serve`, loaded in headless Chromium (Debian's `chromium`, driven by
Playwright without a browser download): behind the API key, given either as credentials in the page's URL
(`http://user:KEY@host/dashboard`, the browser's Basic auth) or as an `Authorization: Bearer` header on
every request (a proxy's or an extension's), it shows a burst of requests as it happens (requests running,
the KV map filling, then cached blocks, tokens/s, times to first token, the errors callers got) in charts
with labelled axes and legends, with no console errors and no failed requests. Without the key it is refused.

`DASHBOARD_SCREENSHOT=docs/dashboard.png` saves the credentialed-URL run's screenshot there (the README's);
without it nothing is written. (Not a TOKENFLOW_ name: tests/conftest.py clears those for every test.)"""

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
SCREENSHOT_ENV = "DASHBOARD_SCREENSHOT"
CONNECTIONS = 6  # more callers than max_num_seqs=4: some wait
SYSTEM = "You are a terse assistant that answers questions about the tokenflow engine. " * 4  # a shared prefix
LONG_WORD = "bogus" * 50  # an error message with a 250-character word: the page must wrap it in its card
AXIS_TITLES = {"queue-chart": ("requests", "seconds ago"), "tok-chart": ("tokens / s", "seconds ago"),
               "kv-chart": ("% of KV blocks", "seconds ago"), "hit-chart": ("hit rate (%)", "seconds ago"),
               "ttft-hist": ("requests", "time to first token (s)"), "step-hist": ("steps", "step time (ms)")}
LEGENDS = {"queue-legend": ("waiting", "running"), "tok-legend": ("tokens/s",), "kv-legend": ("used", "cached"),
           "hit-legend": ("cache",), "ttft-legend": ("requests",), "step-legend": ("steps",)}


def _chromium() -> str:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "the dashboard test needs Debian's chromium (scripts/install.sh --dev installs it)"
    return chromium


def _until(page, expression: str, timeout_s: float) -> None:
    """Poll `expression` in the page from here: the page's CSP forbids the eval Playwright's own waiting uses."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"the page never showed: {expression} ({page.text_content('#updated')})"
        time.sleep(0.1)


def _bad_requests(url: str) -> int:
    """Requests a caller gets wrong (errors for the page to list), one with a message that is one long word."""
    bad = [{"prompt": "x", "max_tokens": -1}, {"prompt": "x", "temperature": "hot"},
           {"prompt": "x", "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": LONG_WORD}}}}]
    for body in bad:
        assert httpx.post(url + "/v1/completions", json=body, headers=BEARER, timeout=30).status_code == 400
    return len(bad)


def _burst(url: str, stop: threading.Event, done: list[int]) -> None:
    """Requests sharing a prefix over CONNECTIONS connections until `stop` (at least 24, so the load outlasts
    the page's polls however fast the host)."""
    def connection(k: int) -> None:
        i = k
        while i < 24 or not stop.is_set():
            body = {"model": "tiny-llama", "prompt": f"{SYSTEM}Question {i}: " + "why? " * (i % 7),
                    "max_tokens": 160, "ignore_eos": True}
            httpx.post(url + "/v1/completions", json=body, headers=BEARER, timeout=120).raise_for_status()
            done.append(i)
            i += CONNECTIONS

    threads = [threading.Thread(target=connection, args=(k,)) for k in range(CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _watch(page) -> list[str]:
    """What went wrong in the page: console errors, uncaught exceptions, failed or refused requests."""
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.url} {r.failure}"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    return problems


def _charts_drawn(page, points: int) -> str:
    """JS: every chart over time has at least `points` polls and a line; every histogram has its bars."""
    return ("['queue-chart', 'tok-chart', 'kv-chart'].every((id) => {"
            f"  const svg = document.getElementById(id); return Number(svg.dataset.points) >= {points}"
            "    && svg.querySelectorAll('polyline.series').length > 0; })"
            " && document.querySelectorAll('#ttft-hist rect.bar').length === 10"
            " && document.querySelectorAll('#step-hist rect.bar').length === 12")


def _check_axes_and_legends(page) -> None:
    for chart, titles in AXIS_TITLES.items():
        drawn = sorted(t.text_content() for t in page.locator(f"#{chart} text.axis-title").all())
        assert drawn == sorted(titles), (chart, drawn)
        ticks = [t.text_content() for t in page.locator(f"#{chart} text.tick").all()]
        assert len(ticks) >= 4 and ("0" in ticks or "0%" in ticks), (chart, ticks)
    for chart in ("kv-chart", "hit-chart"):
        assert "100%" in [t.text_content() for t in page.locator(f"#{chart} text.tick").all()], chart
    for legend, names in LEGENDS.items():
        shown = page.text_content(f"#{legend}")
        assert all(name in shown for name in names), (legend, shown)
        assert page.locator(f"#{legend} .swatch").count() == len(names), (legend, shown)


@pytest.mark.parametrize("how", ["credentials-in-url", "bearer-header", "basic-auth-prompt"])
def test_dashboard_shows_a_burst_live_in_chromium(tiny_model, how) -> None:
    from playwright.sync_api import sync_playwright

    shot = os.environ.get(SCREENSHOT_ENV) if how == "credentials-in-url" else None
    with ServeProcess(tiny_model, "--api-key", KEY, "--set", "max_num_seqs=4") as server:
        snapshot = httpx.get(server.url + "/v1/engine/stats", headers=BEARER, timeout=30).json()
        assert snapshot["stats"]["kv_blocks_total"] > 0 and len(snapshot["step_ms"]["counts"]) == 12

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
            if how == "credentials-in-url":  # the browser logs in with them; the page's fetches must not carry them
                context = browser.new_context(viewport={"width": 1280, "height": 900})
                url = f"http://ops:{KEY}@127.0.0.1:{server.port}/dashboard"
            elif how == "bearer-header":  # a proxy or an extension adds it to every request, the fetches included
                context = browser.new_context(viewport={"width": 1280, "height": 900}, extra_http_headers=BEARER)
                url = server.url + "/dashboard"
            else:  # the key typed into the browser's login prompt (any user name), which it then sends on
                context = browser.new_context(viewport={"width": 1280, "height": 900},
                                              http_credentials={"username": "ops", "password": KEY})
                url = server.url + "/dashboard"
            page = context.new_page()
            problems = _watch(page)
            response = page.goto(url)
            assert response is not None and response.status == 200
            _until(page, "document.getElementById('finished').textContent === '0'", 15)
            assert page.locator("#kv-map div").count() == 256 and page.locator("#kv-map .used").count() == 0

            bad = _bad_requests(server.url)
            done: list[int] = []
            stop = threading.Event()
            burst = threading.Thread(target=_burst, args=(server.url, stop, done))
            burst.start()
            try:
                # under load: requests running, finishing, KV blocks in use, tokens/s, as the page polls
                _until(page, "Number(document.getElementById('running').textContent) > 0", 30)
                _until(page, "document.querySelectorAll('#kv-map .used').length > 0", 30)
                _until(page, "Number(document.getElementById('finished').textContent) > 0", 60)
                _until(page, "Number(document.getElementById('tok-rate').textContent) > 0", 30)
                _until(page, _charts_drawn(page, 15 if shot else 4), 60)
                _check_axes_and_legends(page)
                if shot:
                    page.screenshot(path=shot, full_page=True)
            finally:
                stop.set()
                burst.join()
            finished = len(done)
            assert finished >= 24 and len(set(done)) == finished
            # after it: everyone finished, the prompts' blocks cached, the distributions and errors filled in
            _until(page, f"document.getElementById('finished').textContent === '{finished}'", 15)
            _until(page, "document.querySelectorAll('#kv-map .used').length === 0", 15)
            assert page.locator("#kv-map .cached").count() > 0
            ttft = sum(int(b.get_attribute("data-count")) for b in page.locator("#ttft-hist rect.bar").all())
            steps = sum(int(b.get_attribute("data-count")) for b in page.locator("#step-hist rect.bar").all())
            assert ttft == finished and steps > 100
            assert f"InvalidRequest: {bad}" in page.text_content("#error-counts")
            assert page.locator("#errors tr").count() == bad
            assert page.text_content("#breaker-state") == "closed"
            assert "not updated" not in page.text_content("#updated")
            # the long error wraps inside its card: nothing sticks out, the row is taller than one line
            assert LONG_WORD[:40] in page.text_content("#errors")
            assert page.evaluate("""(() => {
                const card = document.getElementById('errors-card'), right = card.getBoundingClientRect().right;
                const tds = [...card.querySelectorAll('td')];
                return card.scrollWidth <= card.clientWidth && document.documentElement.scrollWidth <= innerWidth
                    && tds.every((td) => td.scrollWidth <= td.clientWidth + 1
                                         && td.getBoundingClientRect().right <= right)
                    && Math.max(...tds.map((td) => td.getBoundingClientRect().height)) > 24;
            })()""")
            box = page.evaluate("(() => { const s = getComputedStyle(document.getElementById('errors-box'));"
                                " return [s.maxHeight, s.overflowY]; })()")
            assert box == ["240px", "auto"]
            browser.close()
    assert problems == [], problems


def test_dashboard_in_chromium_without_the_key_is_refused(tiny_model) -> None:
    """No key, or a wrong one in the URL or the header: the server's 401 asks for Basic auth, and the browser,
    with nothing (else) to answer, gives up on the page; it never polls the stats."""
    from playwright.sync_api import Error, sync_playwright

    with ServeProcess(tiny_model, "--api-key", KEY) as server:
        refused = httpx.get(server.url + "/dashboard", timeout=30)
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
        assert httpx.get(server.url + "/v1/engine/stats", timeout=30).status_code == 401
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
            requested: list[str] = []
            for url, headers in ((server.url + "/dashboard", None),
                                 (f"http://ops:wrong-key@127.0.0.1:{server.port}/dashboard", None),
                                 (server.url + "/dashboard", {"Authorization": "Bearer wrong-key"})):
                context = browser.new_context(extra_http_headers=headers)
                page = context.new_page()
                page.on("request", lambda r: requested.append(r.url))
                with pytest.raises(Error, match="ERR_INVALID_AUTH_CREDENTIALS"):
                    page.goto(url)
                assert page.locator("#finished").count() == 0
                context.close()
            browser.close()
            assert len(requested) == 3 and not [u for u in requested if "engine/stats" in u], requested


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
        stats = httpx.get(server.url + "/v1/engine/stats", auth=("anyone", KEY), timeout=30)
        assert stats.status_code == 200 and stats.json()["recent"] == 2048
