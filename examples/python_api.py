"""The Python API directly: generate, stream and chat concurrently in one event loop.

    python examples/python_api.py
"""

import anyio

import tokenflow


async def main() -> None:
    async with tokenflow.Engine("smollm2-135m") as engine:
        done = await engine.generate("What is the capital of France?", max_tokens=32, temperature=0.0)
        print(done.text, done.usage)

        async def ask(question: str) -> None:
            reply = await engine.chat([{"role": "user", "content": question}], max_tokens=48, temperature=0.0)
            print(f"{question} -> {reply.text!r}")

        async with anyio.create_task_group() as tg:  # continuous batching: these share steps
            for q in ("Name a color.", "Name a fruit.", "Name a planet."):
                tg.start_soon(ask, q)

        async for chunk in engine.stream("Write one sentence about rivers.", max_tokens=40, temperature=0.7, seed=1):
            print(chunk.text, end="", flush=True)
        print()
        print(engine.stats()["prefix_cache_hit_tokens"], "prompt tokens came from the prefix cache")


if __name__ == "__main__":
    anyio.run(main)
