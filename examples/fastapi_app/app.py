"""A FastAPI app with its own routes, plus tokenflow's OpenAI-compatible routes next to them.

    uvicorn examples.fastapi_app.app:app            # the embedded default model
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel

from tokenflow import Engine
from tokenflow.serve.openai_app import engine_lifespan, openai_routes


class SummaryIn(BaseModel):
    text: str
    words: int = 20


def build_app(model: str | None = None, *, engine: Engine | None = None, **settings: Any) -> FastAPI:
    app = FastAPI(lifespan=engine_lifespan(model, engine=engine, **settings))
    app.router.routes.extend(openai_routes())  # /v1/completions, /v1/chat/completions, /health, /metrics, ...

    @app.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    @app.post("/summarize")
    async def summarize(body: SummaryIn, request: Request) -> dict[str, Any]:
        engine: Engine = request.app.state.engine
        done = await engine.chat(
            [{"role": "user", "content": f"Summarize in {body.words} words:\n\n{body.text}"}],
            max_tokens=body.words * 2, temperature=0.0,
        )
        return {"summary": done.text, "tokens": done.usage.completion_tokens, "finish_reason": done.finish_reason}

    return app


app = build_app(os.environ.get("TOKENFLOW_MODEL", "smollm2-135m"))
