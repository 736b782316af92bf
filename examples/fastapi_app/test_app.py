"""The example app's own tests, written with tokenflow's pytest plugin: `tokenflow_engine` is a started
engine on a tiny random-weight model (run with `--tokenflow-model=smollm2-135m` for the real one)."""

from __future__ import annotations

import httpx

from examples.fastapi_app.app import build_app


async def test_summarize_and_openai_routes(tokenflow_engine) -> None:
    app = build_app(engine=tokenflow_engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/hello")).json() == {"hello": "world"}
            summary = (await client.post("/summarize", json={"text": "a long text", "words": 5})).json()
            assert summary["tokens"] <= 10 and summary["finish_reason"] in ("stop", "length")
            chat = await client.post("/v1/chat/completions", json={
                "model": tokenflow_engine.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 4
            unknown = await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
            bad = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
            assert (await client.get("/health")).json() == {"status": "ok"}
    assert tokenflow_engine.stats()["state"] == "running"  # the fixture's engine: the app did not close it
