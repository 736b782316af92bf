"""`Engine.embed` and `/v1/embeddings`: the model's final hidden states pooled, against transformers' base model
and sentence-transformers, computed between generation steps without touching them; hostile inputs refused."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import anyio
import pytest
import torch
from transformers import AutoModel

from tests.servers import Server
from tokenflow import Engine
from tokenflow.errors import InvalidRequest
from tokenflow.testing import build_tiny_model

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello", "Paris is the capital of France, and " * 12]


def _pooled(hidden: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    vector = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0), "max": hidden.max(0).values}[mode]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def _hidden(base: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return base(torch.tensor([ids])).last_hidden_state[0]


# llama: the fused layers; gpt2 and qwen3_moe: their HF modules
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3_moe"])
async def test_embeddings_equal_transformers_pooled_hidden_states(tmp_path: Path, arch: str) -> None:
    folder = build_tiny_model(tmp_path / arch, arch=arch)
    base = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    ids = [list(range(5, 5 + n)) for n in (3, 40, 150)]
    async with Engine(folder, max_batch_tokens=32) as engine:  # the 150-token input runs in 5 chunks
        for mode in ("last", "mean", "cls", "max"):
            for normalize in (True, False):
                got = await engine.embed(ids, pooling=mode, normalize=normalize)
                for row, one in zip(got, ids):
                    want = _pooled(_hidden(base, one), mode, normalize)
                    assert (torch.tensor(row) - want).abs().max().item() < 1e-5, (mode, normalize)
        # the default for a folder without sentence-transformers' modules: last token, unit length
        tokens = await engine.tokenize(TEXTS[0])
        (default,) = await engine.embed(TEXTS[0])
        assert (torch.tensor(default) - _pooled(_hidden(base, tokens), "last", True)).abs().max().item() < 1e-5
        assert await engine.embed(tokens) == [default]


async def test_a_sentence_transformers_folder_embeds_as_sentence_transformers(tmp_path: Path) -> None:
    """Mean pooling and a Normalize module, read from the folder's `modules.json` and `1_Pooling/config.json`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    source = build_tiny_model(tmp_path / "llama")
    (source / "chat_template.jinja").unlink(missing_ok=True)  # plain texts (sentence-transformers 6 would
    # otherwise format them as chat messages through the template)
    word = models.Transformer(str(source))
    word.tokenizer.chat_template = None
    st = SentenceTransformer(modules=[word, models.Pooling(word.get_embedding_dimension(), "mean"),
                                      models.Normalize()], device="cpu")
    folder = tmp_path / "st"
    st.save(str(folder))
    want = st.encode(TEXTS, convert_to_tensor=True).float()
    async with Engine(folder) as engine:
        assert (engine.pooling.mode, engine.pooling.normalize) == ("mean", True)
        got = torch.tensor(await engine.embed(TEXTS))
    assert (got - want).abs().max().item() < 1e-5


async def test_embeddings_run_between_generation_steps_without_changing_them(tiny_model: Path) -> None:
    prompt = list(range(10, 60))
    async with Engine(tiny_model, max_batch_tokens=32) as engine:
        alone = (await engine.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True)).token_ids
        vectors: list[list[list[float]]] = []

        async def embedder() -> None:
            for _ in range(5):
                vectors.append(await engine.embed(TEXTS))

        async with anyio.create_task_group() as tg:
            tg.start_soon(embedder)
            beside = (await engine.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True)).token_ids
        assert beside == alone
        assert all(v == vectors[0] for v in vectors) and len(vectors) == 5
        assert engine.stats()["kv_blocks_used"] == 0  # no KV kept


async def test_hostile_embedding_inputs_are_refused_and_the_engine_serves_on(tiny_model: Path) -> None:
    async with Engine(tiny_model, max_embed_inputs=3) as engine:
        vocab, longest = engine.loaded.vocab_size, engine.loaded.max_model_len
        for bad, field in [([], "input"), (["a"] * 4, "input"), ([[]], "input"), ([[vocab]], "input"),
                           ([[-1]], "input"), ([list(range(5, 9)) * longest], "input"), (42, "input"),
                           ([1.5], "input"), ([["a"]], "input")]:
            with pytest.raises(InvalidRequest) as caught:
                await engine.embed(bad)  # type: ignore[arg-type]
            assert caught.value.field == field, bad
        with pytest.raises(InvalidRequest, match="pooling"):
            await engine.embed("a", pooling="median")
        assert len((await engine.embed(["a", "b"]))[1]) == engine.loaded.model.config.hidden_size
        assert (await engine.generate("hello", max_tokens=3, temperature=0.0)).token_ids


def test_v1_embeddings_through_the_openai_client(tiny_model: Path) -> None:
    with Server(tiny_model) as server:
        client = server.openai_client()
        floats = client.embeddings.create(model="tiny-llama", input=TEXTS, encoding_format="float")
        assert [d.index for d in floats.data] == [0, 1, 2] and floats.usage.prompt_tokens > 0
        packed = client.embeddings.with_raw_response.create(model="tiny-llama", input=TEXTS,
                                                            encoding_format="base64").http_response.json()
        for d, b in zip(floats.data, packed["data"]):
            raw = base64.b64decode(b["embedding"])
            assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(d.embedding, abs=1e-7)
        assert abs(sum(x * x for x in floats.data[0].embedding) - 1) < 1e-4  # unit length by default
        # the openai client's default (base64, decoded by the client) gives the same vectors
        default = client.embeddings.create(model="tiny-llama", input="hello")
        assert default.data[0].embedding == pytest.approx(floats.data[1].embedding, abs=1e-6)
        ids = client.embeddings.create(model="tiny-llama", input=[[5, 6, 7]], encoding_format="float")
        assert len(ids.data) == 1 and ids.usage.prompt_tokens == 3
        import openai

        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model="tiny-llama", input=[])
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model="tiny-llama", input="a", dimensions=3)
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="other", input="a")


def test_sync_engine_embeds(tiny_model: Path) -> None:
    from tokenflow import SyncEngine

    with SyncEngine(tiny_model) as engine:
        (vector,) = engine.embed("hello")
        assert len(vector) == 64 and abs(sum(x * x for x in vector) - 1) < 1e-4
