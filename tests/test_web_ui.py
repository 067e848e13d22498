"""The page at ``/`` of ``dllm serve`` in a real browser: headless Chromium (Debian's
``chromium`` package) driven by Playwright, against a real server of the built-in model
under ``--api-key``. The page asks for the key, runs "What is 17+25?", its canvas passes
through masked states, and it ends showing 42; the screenshot is written to
``$DLLM_TEST_ARTIFACTS`` (default: the test's tmp dir). Skipped, with the reason, where the
browser or Playwright is missing (``pip install -e ".[browser]"``, ``apt-get install -y
chromium``; never ``playwright install``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from dllm.checkpoint import BUILTIN_MODEL_DIR
from tests.test_server import _start, _stop, _wait_ready

CHROMIUM = os.environ.get("DLLM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
KEY = "page-key-17"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _skip_reason() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[browser]')"
    if not os.path.exists(CHROMIUM):
        return f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


@pytest.fixture(scope="module")
def builtin_server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("web-logs")
    server = _start(str(BUILTIN_MODEL_DIR), logs / "builtin.log", "--api-key", KEY)
    try:
        _wait_ready(server, timeout=300)
        yield server
    finally:
        _stop(server)


def test_page_denoises_17_plus_25(builtin_server, tmp_path):
    from playwright.sync_api import sync_playwright

    url = builtin_server.url
    page_html = httpx.get(url + "/", timeout=30)
    assert page_html.status_code == 200 and "<canvas" in page_html.text
    assert "http" not in page_html.text.replace(url, "")  # nothing loaded from elsewhere
    outside: list[str] = []
    artifacts = Path(os.environ.get("DLLM_TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=ARGS,
            viewport={"width": 1100, "height": 900},
            bypass_csp=True)  # the page's CSP forbids eval, which the test's probes use
        try:
            page = ctx.new_page()
            page.on("request", lambda r: None if r.url.startswith(url) else outside.append(r.url))
            page.goto(url + "/")
            # Under --api-key the page cannot list the model: it asks for the key.
            page.wait_for_selector("#key-row:not([hidden])", timeout=30_000)
            page.fill("#api-key", KEY)
            page.click("#key-save")
            page.wait_for_function(
                "document.getElementById('model').textContent.startsWith('model:')",
                timeout=30_000)
            # One token per forward, so the canvas shows the block partly filled.
            page.select_option("#algorithm", "low_confidence_static")
            page.fill("#settings", '{"steps_per_block": 8}')
            page.fill("#prompt", "What is 17+25?")
            page.click("#go")
            page.wait_for_function("window.dllmHistory.some(h => h.final)", timeout=120_000)
            history = page.evaluate("window.dllmHistory")
            answer = page.inner_text("#answer")
            rows = page.locator("#timelines .timeline").first.locator(".fwd").count()
            stats = page.inner_text("#stats")
            page.screenshot(path=str(artifacts / "watch-it-denoise.png"), full_page=True)
        finally:
            ctx.close()
    states = [h for h in history if not h.get("final")]
    assert states[0]["masked"] > 0 and states[0]["step"] == -1  # a block starts all masked
    assert any(0 < s["masked"] < states[0]["masked"] for s in states), "never partly filled"
    assert states[-1]["masked"] == 0
    assert "42" in answer and history[-1]["answer"] == answer
    forwards = sum(1 for s in states if s["step"] >= 0)
    assert rows == forwards and f"{forwards} denoise forwards" in stats
    assert not outside, f"the page asked elsewhere: {outside}"
    assert (artifacts / "watch-it-denoise.png").stat().st_size > 10_000


def test_page_assets_and_no_web_ui():
    """The page's files come from the package; ``--no-web-ui`` serves none (in-process app,
    no model needed for these routes)."""
    import asyncio

    from dllm.config import EngineConfig
    from dllm.server.app import build_app
    from dllm.server.args import ServerConfig

    async def get(app, path):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get(path)

    on = build_app(ServerConfig(engine=EngineConfig(model=str(BUILTIN_MODEL_DIR))))
    off = build_app(ServerConfig(engine=EngineConfig(model=str(BUILTIN_MODEL_DIR)), no_web_ui=True))
    for path, kind in (("/", "text/html"), ("/web/app.js", "text/javascript"),
                       ("/web/style.css", "text/css")):
        r = asyncio.run(get(on, path))
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert "default-src 'self'" in r.headers["content-security-policy"]
        assert asyncio.run(get(off, path)).status_code == 404
    assert asyncio.run(get(on, "/web/../pyproject.toml")).status_code == 404
    assert asyncio.run(get(on, "/web/info.json")).status_code == 503  # the model is loading
