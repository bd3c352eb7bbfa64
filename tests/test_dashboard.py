"""The KV block-map dashboard in a real headless Chromium against the real stack.

`pagedserve serve` runs with a small GPU pool (64 blocks of 16 tokens) and swap preemption,
so a handful of requests shows every state of a block: shared by a cached prompt prefix and
by forked samples (ref count > 1), swapped out to the CPU pool, and free again. What the test
reads is the page's own data (`window.__pagedserve.counts`, computed by the page from the
snapshots it received), never Redis or the scheduler directly. The screenshots it takes are
the ones in docs/.
"""
from __future__ import annotations

import os
import threading
import time
import urllib.request

import httpx
import pytest
import redis

from shared.redis_keys import RedisKeys
from tests.browser import Browser
from tests.conftest import REPO, start_stack, stop_process

KEY = "dash-test-key"
DOCS = os.path.join(REPO, "docs")


@pytest.fixture(scope="module")
def small_stack(redis_server):
    s = start_stack(redis_server.url, "--num-gpu-blocks", "64", "--preemption-mode", "swap",
                    api_key=KEY)
    yield s
    stop_process(s.proc, timeout=20)


@pytest.fixture
def browser():
    b = Browser()
    yield b
    b.close()


def _status(url: str, headers: dict | None = None) -> int:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _complete(base: str, bodies: list[dict]) -> list[threading.Thread]:
    def run(body):
        r = httpx.post(base + "/v1/completions", json=body, timeout=300,
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
    threads = [threading.Thread(target=run, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    return threads


def _wait(browser: Browser, predicate: str, timeout: float) -> float:
    """Seconds until the page-side JS `predicate` holds, over `c` (the page's counts) and `s`
    (the snapshot it draws)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if browser.evaluate(f"(() => {{ const c = window.__pagedserve.counts, "
                            f"s = window.__pagedserve.snapshot; return !!c && ({predicate}); }})()"):
            return time.monotonic() - start
        time.sleep(0.05)
    counts = browser.evaluate("JSON.stringify(window.__pagedserve.counts)")
    raise AssertionError(f"the page never showed {predicate} in {timeout} s; counts: {counts}")


def test_dashboard_needs_the_key_like_v1(small_stack):
    base = small_stack.base_url
    assert _status(base + "/dashboard") == 401
    assert _status(base + "/dashboard/stream") == 401
    assert _status(base + "/dashboard?key=wrong") == 401
    assert _status(base + "/dashboard", {"Authorization": f"Bearer {KEY}"}) == 200
    with urllib.request.urlopen(base + f"/dashboard?key={KEY}", timeout=5) as r:
        html = r.read().decode()
        assert "pagedserve_key=" in r.headers["set-cookie"]
    # self-contained: nothing is fetched from another origin
    assert "http://" not in html and "https://" not in html and "<canvas" in html


def test_block_map_shows_sharing_swap_and_release(small_stack, browser):
    base = small_stack.base_url
    prefix = RedisKeys(f"t{small_stack.ports['http']}")
    r = redis.Redis.from_url(small_stack.redis_url)
    time.sleep(1.5)
    assert not r.keys(prefix.dashboard("*")), "a snapshot was published with no page open"

    browser.goto(base + f"/dashboard?key={KEY}")
    _wait(browser, "c.gpuBlocks === 64 && c.gpuUsed === 0", 20)
    assert r.keys(prefix.dashboard("*")), "no snapshot in Redis while the page is open"
    replicas = browser.evaluate("window.__pagedserve.replicas")
    assert len(replicas) == 1

    # Three prompts sharing a long prefix (prefix cache) and one request with n = 4 (forks).
    shared = "The quick brown fox jumps over the lazy dog. " * 30
    bodies = [{"prompt": shared + f"Question {i}: what next?", "max_tokens": 48,
               "temperature": 0, "ignore_eos": True} for i in range(3)]
    # (a prompt of several blocks: its full blocks are shared, its partial last one is not)
    bodies.append({"prompt": "Count slowly from one to twenty, one number a line. " * 6,
                   "max_tokens": 48, "n": 4,
                   "temperature": 0.8, "seed": 1, "ignore_eos": True})
    threads = _complete(base, bodies)
    # the three prompts map the same cached prefix blocks (the page's ref counts say > 1)
    _wait(browser, "c.maxRef >= 3 && s.reqs.filter(r => r[7].length === 1 && r[4] >= 10)"
                   ".length === 3", 60)
    # the n = 4 request's four seqs, once forked, map their prompt's blocks together
    _wait(browser, "s.reqs.some(r => r[7].length === 4 && r[4] > 0)", 60)
    assert browser.evaluate("window.__pagedserve.counts.gpuShared") > 0
    # click: that request's block table; a click on a shared cell describes who maps it
    browser.evaluate("[...document.querySelectorAll('#requests tbody tr')]"
                     ".find(tr => window.__pagedserve.snapshot.reqs.find("
                     "r => r[0] === tr.dataset.request)[7].length === 4).click()")
    x, y = browser.evaluate("""(() => {
        const r = document.getElementById('map').getBoundingClientRect();
        const g = window.__pagedserve.layout.g, b = window.__pagedserve.counts.firstShared;
        return [r.left + (b % g.cols + 0.5) * g.cell, r.top + (Math.floor(b / g.cols) + 0.5) * g.cell];
        })()""")
    for kind in ("mousePressed", "mouseReleased"):
        browser.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
    text = browser.evaluate("document.getElementById('cell').textContent")
    assert "in use, ref count" in text and "mapped by" in text, text
    ref = int(text.split("ref count ")[1].split(",")[0])
    assert ref > 1 and text.count("(seq ") == ref, text
    browser.screenshot(os.path.join(DOCS, "dashboard.png"))
    for t in threads:
        t.join(300)
    took = _wait(browser, "c.gpuUsed === 0 && c.requests === 0", 2.0)
    assert took <= 2.0
    assert browser.evaluate("window.__pagedserve.counts.gpuCachedFree") > 0

    # Four requests that together outgrow the 64-block pool: preemption swaps one out.
    bodies = [{"prompt": f"Story {i}: " + "once upon a time there was a server. " * 20,
               "max_tokens": 260, "temperature": 0, "ignore_eos": True} for i in range(4)]
    threads = _complete(base, bodies)
    _wait(browser, "c.cpuUsed > 0 && c.swapped > 0", 180)
    if browser.evaluate("(() => { const tr = document.querySelector("
                        "'#requests tr[data-status=swapped]'); tr && tr.click(); return !!tr; })()"):
        title = browser.evaluate("document.getElementById('table-title').textContent")
        assert "(swapped)" in title, title
    browser.screenshot(os.path.join(DOCS, "dashboard-swap.png"))
    for t in threads:
        t.join(300)
    _wait(browser, "c.gpuUsed === 0 && c.cpuUsed === 0", 2.0)

    browser.pump()
    assert browser.errors == []
