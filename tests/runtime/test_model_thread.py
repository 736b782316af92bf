"""Every torch call of the model stage runs on one thread (see `tokenflow/model_thread.py`):
model loading, KV allocation and every step, whatever else runs in worker threads meanwhile."""

from __future__ import annotations

import functools
import threading

import anyio
import pytest

import tokenflow.engine
from tokenflow import Engine
from tokenflow.runtime.model_thread import ModelThread


@pytest.mark.parametrize("backend", ["paged", "hf"])
async def test_load_and_every_step_run_on_the_model_thread(tiny_model, backend, monkeypatch) -> None:
    loaded_on: list[int] = []

    def recording_load(*args):
        loaded_on.append(threading.get_ident())
        return load_model(*args)

    load_model = tokenflow.engine.load_model
    monkeypatch.setattr(tokenflow.engine, "load_model", recording_load)
    async with Engine(tiny_model, backend=backend, max_num_seqs=4, max_batch_tokens=32) as engine:
        model_thread = engine._model_thread.thread_id
        assert model_thread is not None and model_thread != threading.get_ident()
        assert loaded_on == [model_thread]
        seen: set[int] = set()
        loop_backend = engine._loop.backend
        method = "execute" if backend == "paged" else "run_batch"
        original = getattr(loop_backend, method)

        def recording(*args, **kwargs):
            seen.add(threading.get_ident())
            return original(*args, **kwargs)

        setattr(loop_backend, method, recording)
        async with anyio.create_task_group() as tg:  # tokenizer jobs use worker threads meanwhile
            for i in range(12):
                tg.start_soon(functools.partial(engine.generate, f"prompt number {i} " * (i + 1), max_tokens=6))
        assert seen == {model_thread}


async def test_errors_reach_the_caller_and_the_thread_keeps_serving() -> None:
    model_thread = ModelThread()
    async with anyio.create_task_group() as tg:
        tg.start_soon(model_thread.serve)

        def fail() -> None:
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            await model_thread.run(fail)
        assert await model_thread.run(lambda a, b: a + b, 2, 3) == 5
        ids = {await model_thread.run(threading.get_ident) for _ in range(5)}
        assert ids == {model_thread.thread_id}
        model_thread.close()
