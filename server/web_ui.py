"""The page ``dllm serve`` shows at ``/`` (``--no-web-ui`` turns it off): static files of
this package (``server/web/``), no build step, nothing loaded from elsewhere. The page asks
the API itself (with the key it asks for under ``--api-key``); ``/web/info.json`` tells it
the algorithms and the engine's defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response

from dllm.algorithms import ALGORITHMS
from dllm.server.protocol import APIError

WEB_DIR = Path(__file__).parent / "web"
FILES = {"app.js": "text/javascript", "style.css": "text/css"}
# No request leaves for anywhere but this server; no inline script runs.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'")


def add_web_routes(app: FastAPI, state: Any) -> None:
    """``state``: the app's ``ServerState`` (the engine may still be loading)."""
    headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache"}

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(WEB_DIR / "index.html", media_type="text/html", headers=headers)

    @app.get("/web/info.json", include_in_schema=False)
    async def web_info() -> Response:
        s = state.ready()
        engine = s.llm.engine
        return JSONResponse({
            "algorithms": {name: dict(cls.defaults) for name, cls in ALGORITHMS.items()},
            "default_algorithm": engine.algorithm_name,
            "default_config": engine.algorithm_config,
            "block_size": engine.block_size,
            "chat": engine.tokenizer.chat_template is not None,
        }, headers=headers)

    @app.get("/web/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in FILES:
            raise APIError(404, f"no such file: /web/{name[:100]}", "not_found_error")
        return FileResponse(WEB_DIR / name, media_type=FILES[name], headers=headers)
