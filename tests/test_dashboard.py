"""The KV block-map dashboard in a real headless Chromium against the real stack.

`pagedserve serve` runs with a small GPU pool (64 blocks of 16 tokens) and swap preemption,
so a handful of requests shows every state of a block: shared by a cached prompt prefix and
by forked samples (ref count > 1), swapped out to the CPU pool, and free again. A second
stack has two scheduler replicas, one of them driving a tensor-parallel executor group, on a
tiny random model. What the tests read is the page's own data (`window.__pagedserve.counts`,
computed by the page from the snapshots it received), never Redis or the scheduler directly.
The screenshots they take go to a temporary folder; with PAGEDSERVE_DOCS_SCREENSHOTS=1 they
replace the ones in docs/ (a test run leaves the checkout as it found it).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from shared.control import ExecutorClient
from shared.redis_keys import RedisKeys
from services.gateway.dashboard import POLL_S
from services.scheduler.service import SchedulerServiceConfig
from tests.browser import Browser
from tests.cluster import Cluster
from tests.conftest import REPO, free_port, free_ports, start_stack, stop_process

KEY = "dash-test-key"
DOCS = os.path.join(REPO, "docs")


@pytest.fixture
def shots(tmp_path) -> str:
    """Where the screenshots go: docs/ when asked (see above), else a temporary folder."""
    return DOCS if os.environ.get("PAGEDSERVE_DOCS_SCREENSHOTS") == "1" else str(tmp_path)


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


TP_BLOCKS, ONE_BLOCKS = 140, 180    # the two replicas' pools: the page tells them apart by size


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama (4 query heads, 2 KV heads, so TP = 2 splits them) behind the
    bundled model's tokenizer: every service serves it, and it loads and runs in seconds."""
    from shared.model_source import load_tokenizer, resolve_model
    from tests.executor.conftest import make_tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = load_tokenizer(resolve_model())
    make_tiny_checkpoint(folder, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def two_replicas(redis_server, tiny_model):
    """sched-a drives a TP = 2 executor group, sched-b a single executor; each runs one
    request at a time."""
    model = ["--model", tiny_model]
    c = Cluster(redis_server.url, sched_flags=[*model, "--max-num-seqs", "1"],
                exec_flags=[*model, "--swap-space-gib", "0.001"], gateway_flags=model)
    tp = ("--tensor-parallel-size", "2", "--dist-port", str(free_port()),
          "--zmq-port", str(free_ports(3)), "--num-gpu-blocks", str(TP_BLOCKS))
    try:
        with ThreadPoolExecutor(3) as pool:
            for job in [pool.submit(c.start_executor, "exec-a", flags=tp),
                        pool.submit(c.start_executor, "exec-b",
                                    flags=("--num-gpu-blocks", str(ONE_BLOCKS))),
                        pool.submit(c.start_gateway)]:
                job.result()
            for job in [pool.submit(c.start_scheduler, "sched-a", "exec-a"),
                        pool.submit(c.start_scheduler, "sched-b", "exec-b")]:
                job.result()
        yield c
    finally:
        c.stop_all()


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


def _hang_up_on(stop: threading.Event, base: str, bodies: list[dict],
                failed: list) -> list[threading.Thread]:
    """Stream each body as a completion on a raw socket of its own, read it until `stop` is
    set, then close the socket: the gateway aborts what still runs. A socket, not a client
    library, so that a stream with nothing to read (its request swapped out) hangs up on
    time too. What went wrong, if anything, is appended to `failed`."""
    host, port = base.removeprefix("http://").split(":")

    def run(body: dict) -> None:
        payload = json.dumps(dict(body, stream=True)).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: %b\r\n"
                         b"authorization: Bearer %b\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (host.encode(), KEY.encode(),
                                                            len(payload), payload))
            sock.settimeout(0.1)
            head = b""
            while not stop.is_set():
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    failed.append(f"the gateway closed the stream of {body['prompt'][:10]}")
                    return
                head = head or data
            if not head.startswith(b"HTTP/1.1 200"):
                failed.append(head[:300])
    threads = [threading.Thread(target=run, args=(b,), daemon=True) for b in bodies]
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


def _stream_until(base: str, request_id: str, stop: threading.Event, failed: list) -> None:
    """Stream one long completion (up to 125 blocks); hang up, which aborts it, once `stop`
    is set. What went wrong, if anything, is appended to `failed`."""
    body = {"prompt": "Tell me a very long story about a lighthouse.", "max_tokens": 1980,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300,
                      headers={"X-Request-Id": request_id}) as r:
        if r.status_code != 200:
            failed.append(r.read())
            return
        for _ in r.iter_lines():
            if stop.is_set():
                return
    failed.append(f"{request_id} ended before the test hung up")


def _click_cell(browser: Browser, block: int) -> str:
    """A real mouse click on GPU block `block` of the map; the cell description it shows."""
    x, y = browser.evaluate(f"""(() => {{
        const r = document.getElementById('map').getBoundingClientRect();
        const g = window.__pagedserve.layout.g, b = {block};
        return [r.left + (b % g.cols + 0.5) * g.cell,
                r.top + (Math.floor(b / g.cols) + 0.5) * g.cell];
        }})()""")
    for kind in ("mousePressed", "mouseReleased"):
        browser.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
    return browser.evaluate("document.getElementById('cell').textContent")


def _pick(browser: Browser, replica: str) -> None:
    """Choose `replica` in the page's picker, as a user's selection does."""
    browser.evaluate(f"""(() => {{ const s = document.getElementById('replica');
        s.value = {json.dumps(replica)}; s.dispatchEvent(new Event('change')); }})()""")


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


def test_block_map_shows_sharing_swap_and_release(small_stack, browser, shots):
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
    text = _click_cell(browser, browser.evaluate("window.__pagedserve.counts.firstShared"))
    assert "in use, ref count" in text and "mapped by" in text, text
    ref = int(text.split("ref count ")[1].split(",")[0])
    assert ref > 1 and text.count("(seq ") == ref, text
    browser.screenshot(os.path.join(shots, "dashboard.png"))
    for t in threads:
        t.join(300)
    # the live page shows the release (a page that stopped following the stream never
    # does); 10 s is 40 of the gateway's 0.25 s polls, room for a loaded machine
    _wait(browser, "c.gpuUsed === 0 && c.requests === 0", 40 * POLL_S)
    assert browser.evaluate("window.__pagedserve.counts.gpuCachedFree") > 0

    # Four requests that together outgrow the 64-block pool: preemption swaps one out.
    bodies = [{"prompt": f"Story {i}: " + "once upon a time there was a server. " * 20,
               "max_tokens": 260, "temperature": 0, "ignore_eos": True} for i in range(4)]
    hang_up, failed = threading.Event(), []
    threads = _hang_up_on(hang_up, base, bodies, failed)
    try:
        _wait(browser, "c.cpuUsed > 0 && c.swapped > 0", 180)
        if browser.evaluate("(() => { const tr = document.querySelector("
                            "'#requests tr[data-status=swapped]'); tr && tr.click(); "
                            "return !!tr; })()"):
            title = browser.evaluate("document.getElementById('table-title').textContent")
            assert "(swapped)" in title, title
        browser.screenshot(os.path.join(shots, "dashboard-swap.png"))
    finally:
        # Every client hangs up, the swapped-out one too: the page shows both pools emptied.
        hang_up.set()
    for t in threads:
        t.join(30)
    assert failed == []
    _wait(browser, "c.gpuUsed === 0 && c.cpuUsed === 0 && c.requests === 0", 40 * POLL_S)

    browser.pump()
    assert browser.errors == []


def test_the_picked_replica_shows_its_own_pool_and_a_tensor_parallel_group_one_map(
        two_replicas, browser, shots):
    c = two_replicas
    info = ExecutorClient(f"127.0.0.1:{c.executors['exec-a'][0]}").describe()
    assert info.tensor_parallel_size == 2 and len(info.plan_endpoints) == 2
    browser.goto(c.base_url + "/dashboard")
    _wait(browser, "window.__pagedserve.replicas.length === 2", 30)
    # one entry per scheduler; the TP group's ranks add none
    assert browser.evaluate("[...document.querySelectorAll('#replica option')]"
                            ".map(o => o.value)") == ["sched-a", "sched-b"]

    # A replica takes at most 1 + read_headroom requests from the queue (it runs one at a
    # time), so one request more than that leaves some for the other: both hold requests.
    stop, failed = threading.Event(), []
    ids = [f"cmpl-dash-replica-{i}" for i in range(SchedulerServiceConfig().read_headroom + 2)]
    threads = [threading.Thread(target=_stream_until,
                                args=(c.base_url, i.removeprefix("cmpl-"), stop, failed))
               for i in ids]
    for t in threads:
        t.start()
    shown = {}
    try:
        for name, blocks, tp in (("sched-a", TP_BLOCKS, 2), ("sched-b", ONE_BLOCKS, 1)):
            _pick(browser, name)
            # that replica's pool (its own size), its running request, the blocks it holds
            _wait(browser, f"c.replica === '{name}' && c.gpuBlocks === {blocks} && c.tp === {tp}"
                           " && s.reqs.filter(r => r[1] === 'running' && r[3] > 0).length === 1"
                           " && c.gpuUsed === s.reqs.reduce((n, r) => n + r[3], 0)", 60)
            rows = browser.evaluate("[...document.querySelectorAll('#requests tbody tr')]"
                                    ".map(tr => [tr.dataset.request, tr.dataset.status])")
            shown[name] = {r for r, _ in rows}
            running = [r for r, status in rows if status == "running"]
            assert len(running) == 1 and shown[name] <= set(ids), rows
            note = browser.evaluate("document.getElementById('tp-note').textContent")
            assert ("2 tensor-parallel ranks" in note) == (tp == 2), note
            # its block table, and a click on its first block names it
            browser.evaluate("document.querySelector('#requests tr[data-status=running]').click()")
            title = browser.evaluate("document.getElementById('table-title').textContent")
            assert title.startswith(running[0]), title
            table = browser.evaluate("window.__pagedserve.snapshot.reqs.find("
                                     "r => r[1] === 'running')[7][0][2]")
            assert table and max(table) < blocks, table
            text = _click_cell(browser, table[0])
            assert f"GPU block {table[0]}: in use, ref count 1" in text, text
            assert f"mapped by {running[0]}" in text, text
            if tp == 2:
                browser.screenshot(os.path.join(shots, "dashboard-replicas.png"))
        # each replica shows the requests it holds, none of the other's
        assert not shown["sched-a"] & shown["sched-b"], shown
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failed == []
    for name in ("sched-b", "sched-a"):
        _pick(browser, name)
        _wait(browser, f"c.replica === '{name}' && c.gpuUsed === 0 && c.requests === 0", 10)
    browser.pump()
    assert browser.errors == []
