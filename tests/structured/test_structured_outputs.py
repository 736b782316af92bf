"""Structured outputs: every sampled output matches its JSON schema, regex, choice or grammar, even from a
random-weight model at temperature 1 (the model pushes against the constraint at every token); bad
constraints are typed errors that cost nobody else their request; unconstrained rows of the same step are
untouched."""

from __future__ import annotations

import json
import re

import anyio
import jsonschema
import pytest

from tokenflow import Engine
from tokenflow.errors import InvalidRequest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}


async def _many(engine: Engine, count: int, **kwargs) -> list[str]:
    texts: list[str] = []

    async def one(seed: int) -> None:
        done = await engine.generate("Describe a person:", temperature=1.0, seed=seed, max_tokens=400, **kwargs)
        assert done.finish_reason == "stop", (done.finish_reason, done.text)
        texts.append(done.text)

    async with anyio.create_task_group() as tg:
        for seed in range(count):
            tg.start_soon(one, seed)
    return texts


async def test_json_schema_holds_for_every_sample(tiny_model) -> None:
    async with Engine(tiny_model, max_num_seqs=8) as engine:
        texts = await _many(engine, 16, json_schema=PERSON)
        for text in texts:
            jsonschema.validate(json.loads(text), PERSON)
        assert len(set(texts)) > 8  # sampled, not one canned answer
        as_text = await engine.generate("x", json_schema=json.dumps(PERSON), temperature=1.0, seed=3, max_tokens=400)
        jsonschema.validate(json.loads(as_text.text), PERSON)
        assert engine.stats()["structured"]["grammars_compiled"] == 1  # the dict and its JSON text: one grammar


async def test_json_object_regex_choice_and_grammar(tiny_model) -> None:
    async with Engine(tiny_model, max_num_seqs=8) as engine:
        small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False}
        for text in await _many(engine, 6, json_schema=small):
            assert text in ('{"ok": true}', '{"ok": false}'), text  # the layout: one space after ':'
        for text in await _many(engine, 8, regex=r"[A-Z][a-z]{2,5}-[0-9]{3}"):
            assert re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{3}", text), text
        choices = ["red", "green", "blue\n\"quoted\""]
        picked = await _many(engine, 12, choice=choices)
        assert set(picked) <= set(choices) and len(set(picked)) > 1
        lark = 'start: "(" num " " op " " num ")"\nop: "+" | "-" | "*"\nnum: /[1-9][0-9]?/'
        for text in await _many(engine, 6, grammar=lark):
            assert re.fullmatch(r"\([1-9][0-9]? [+*-] [1-9][0-9]?\)", text), text


async def test_bad_constraints_are_typed_errors_and_others_are_served(tiny_model) -> None:
    """Each bad constraint is refused with an InvalidRequest naming its field (a refusal that never came, e.g. a
    grammar compiling or waiting forever, fails on the hang guard instead of stalling the suite), and the engine
    serves a good request after them."""
    async with Engine(tiny_model, max_num_seqs=4, max_grammar_chars=2000) as engine:
        good = engine.generate("hello", max_tokens=20, temperature=0.0, ignore_eos=True)
        cases = {
            "regex": dict(regex="(unclosed"),
            "json_schema": dict(json_schema={"type": "no-such-type"}),
            "grammar": dict(grammar="start: undefined_rule"),
            "choice": dict(choice=[]),
        }
        for field, kwargs in cases.items():
            with pytest.raises(InvalidRequest) as info, anyio.fail_after(60):  # a hang guard, not a speed limit
                await engine.generate("x", max_tokens=5, **kwargs)
            assert info.value.field == field, (field, info.value)
        with pytest.raises(InvalidRequest) as info:
            await engine.generate("x", json_schema="{not json")
        assert info.value.field == "json_schema"
        with pytest.raises(InvalidRequest) as info:
            await engine.generate("x", regex="a" * 3000)
        assert info.value.field == "regex" and "max_grammar_chars" in str(info.value)
        with pytest.raises(InvalidRequest) as info:
            await engine.generate("x", regex="a+", choice=["a"])
        assert info.value.field == "choice"
        assert (await good).usage.completion_tokens == 20
        assert engine.stats()["num_running"] == 0


@pytest.mark.parametrize("count", [5_000, 50_000])
async def test_thousands_of_choices_are_enforced(tiny_model, count: int) -> None:
    """Up to 2,000 choices were rule alternatives, each an Earley item; past llguidance's 2,000 items a row
    it gave up after the first token and the answer ended as "stop" on a prefix ("o" of "option5")."""
    choices = [f"opt{i}" for i in range(count)] + ["one with \"quotes\" and \\", "ünïcode"]
    chars = sum(len(c) for c in choices)  # what max_grammar_chars counts of a choice list
    async with Engine(tiny_model, max_num_seqs=8, max_grammar_chars=chars) as engine:
        texts = await _many(engine, 8, choice=choices)
        assert set(texts) <= set(choices), [t for t in texts if t not in choices]
        greedy = await engine.generate("pick one", choice=choices, temperature=0.0, max_tokens=40)
        assert greedy.text in choices and greedy.finish_reason == "stop"
    async with Engine(tiny_model, max_grammar_chars=chars - 1) as engine:  # past the limit: a 400, up front
        with pytest.raises(InvalidRequest) as info:
            await engine.generate("x", choice=choices)
        assert info.value.field == "choice" and "max_grammar_chars" in str(info.value)


async def test_a_constraint_the_grammar_engine_gives_up_on_fails_the_request(tiny_model) -> None:
    """A grammar past llguidance's limits mid-answer (3,000 rule alternatives: too many Earley items in a row)
    fails its request with an InvalidRequest naming the field, never a "stop" on unchecked output; the
    others are served."""
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(3000))
    async with Engine(tiny_model, max_num_seqs=4, max_grammar_chars=100_000) as engine:
        good = engine.generate("hello", max_tokens=20, temperature=0.0, ignore_eos=True)
        with pytest.raises(InvalidRequest) as info:
            await engine.generate("x", grammar=grammar, max_tokens=20, temperature=0.0)
        assert info.value.field == "grammar" and "could not be enforced" in str(info.value)
        assert (await good).usage.completion_tokens == 20
        assert engine.stats()["num_running"] == 0 and engine.stats()["kv_blocks_used"] == 0


async def test_the_static_backend_refuses_constraints(tiny_model) -> None:
    async with Engine(tiny_model, backend="hf") as engine:
        with pytest.raises(InvalidRequest) as info:
            await engine.generate("x", regex="a+", max_tokens=3)
        assert info.value.field == "regex"
        assert (await engine.generate("x", max_tokens=3, temperature=0.0, ignore_eos=True)).usage.completion_tokens == 3


async def test_unconstrained_rows_of_a_mixed_step_are_unchanged(tiny_model) -> None:
    async with Engine(tiny_model, max_num_seqs=8) as engine:
        alone = await engine.generate("the river", max_tokens=24, temperature=0.0, ignore_eos=True)
        results = {}

        async def constrained(seed: int) -> None:
            await engine.generate("x", json_schema=PERSON, temperature=1.0, seed=seed, max_tokens=400)

        async def free() -> None:
            results["free"] = await engine.generate("the river", max_tokens=24, temperature=0.0, ignore_eos=True)

        async with anyio.create_task_group() as tg:
            for seed in range(4):
                tg.start_soon(constrained, seed)
            tg.start_soon(free)
        assert results["free"].token_ids == alone.token_ids


async def test_constrained_output_survives_preemption(tiny_model) -> None:
    """Too few KV blocks for all: requests are preempted and recomputed, their grammar state carried over."""
    async with Engine(tiny_model, max_num_seqs=8, num_kv_blocks=28, block_size=16) as engine:
        texts = await _many(engine, 8, json_schema=PERSON)
        for text in texts:
            jsonschema.validate(json.loads(text), PERSON)
        assert engine.stats()["num_preemptions"] > 0


async def test_real_model_answers_in_json(real_model) -> None:
    """The real model writes an object for json_object and fills a schema with plausible values."""
    async with Engine(real_model, max_num_seqs=4) as engine:
        messages = [{"role": "user", "content": "Describe a cat as a JSON object."}]
        done = await engine.chat(messages, json_object=True, temperature=0.0, max_tokens=200)
        assert done.finish_reason == "stop" and isinstance(json.loads(done.text), dict), done.text
        messages = [{"role": "user", "content": "Invent a user of a web shop, as JSON."}]
        for seed in range(3):
            done = await engine.chat(messages, json_schema=PERSON, temperature=1.0, seed=seed, max_tokens=300)
            assert done.finish_reason == "stop", done.text
            jsonschema.validate(json.loads(done.text), PERSON)


# -- over HTTP, with the official openai client ----------------------------------------------------------
@pytest.fixture(scope="module")
def client(tiny_model):

    from tests.servers import Server

    with Server(tiny_model, max_num_seqs=8) as server:
        yield server.openai_client()


def test_http_response_format_json_schema(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(4):
        done = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "who?"}],
                                              response_format=fmt, temperature=1.0, seed=seed, max_tokens=400)
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), PERSON)
    done = client.completions.create(model="tiny-llama", prompt="x", max_tokens=50, temperature=1.0, seed=1,
                                     extra_body={"response_format": {"type": "json_object"}, "min_tokens": 0})
    assert done.choices[0].text.startswith("{")


def test_http_structured_outputs_extra(client) -> None:
    choices = ["positive", "negative", "neutral"]
    for seed in range(4):
        done = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "sentiment?"}], temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"choice": choices}})
        assert done.choices[0].message.content in choices
    done = client.completions.create(model="tiny-llama", prompt="date:", temperature=1.0, seed=2, max_tokens=30,
                                     extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", done.choices[0].text)


def test_http_refusals(client) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert info.value.body["param"] == "regex"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "xml"})
    assert info.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, extra_body={"suffix": "y"})
    assert info.value.body["param"] == "suffix"
    assert client.completions.create(model="tiny-llama", prompt="x", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("masked_first", [False, True])
async def test_constrained_draws_follow_the_masked_distribution(tiny_model, masked_first) -> None:
    """A row without logprobs or top-k/top-p/min-p is sampled unconstrained and drawn again under its mask
    only when the grammar refuses the token; both ways the first token's frequencies must be the model's
    softmax restricted to the allowed tokens (here the ten digits of `[0-9]`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    digits = {tokenizer.convert_tokens_to_ids(d): d for d in "0123456789"}
    prompt = "the number is"
    ids = tokenizer(prompt)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    allowed = torch.tensor(sorted(digits))
    expected = dict(zip((digits[t] for t in allowed.tolist()), torch.softmax(logits[allowed], -1).tolist()))
    extra = {"logprobs": 0} if masked_first else {}
    draws = 1280
    async with Engine(tiny_model, max_num_seqs=16, dtype="float32") as engine:
        done = [c for batch in range(draws // 16) for c in await engine.generate_many(
            ids, 16, regex="[0-9]", temperature=1.0, seed=1000 * batch, max_tokens=4, **extra)]
        resampled = engine.stats()["num_masked_resamples"]
    counts = {d: sum(c.text == d for c in done) for d in expected}
    assert sum(counts.values()) == draws
    total_variation = 0.5 * sum(abs(counts[d] / draws - p) for d, p in expected.items())
    assert total_variation < 0.07, (counts, expected)  # a uniform draw is 0.34 away
    if masked_first:
        assert resampled == 0
    else:  # a random-weight model mostly prefers a non-digit: most first draws were refused and redrawn
        assert resampled > draws / 2


async def test_constrained_greedy_speculation_equals_plain_constrained_greedy(tiny_model, monkeypatch) -> None:
    """Drafts of constrained greedy requests are checked against the grammar: oracle drafts (the plain
    constrained output, one guess in three spoiled) are accepted where the raw argmax is refused and the
    masked one agrees, and n-gram drafts are trimmed to what the grammar allows; outputs never change."""
    from tests.scheduler.test_ngram_speculation import _oracle_drafts, _repetitive_prompts

    prompts = _repetitive_prompts(400, 4, seed=3)
    kwargs = dict(max_tokens=120, temperature=0.0, json_schema=PERSON)
    async with Engine(tiny_model, max_num_seqs=4) as engine:
        ref = [(await engine.generate(p, **kwargs)).token_ids for p in prompts]
    for oracle in (True, False):
        with monkeypatch.context() as patch:
            if oracle:
                patch.setattr("tokenflow.scheduler.scheduler.propose_draft", _oracle_drafts(prompts, ref))
            async with Engine(tiny_model, max_num_seqs=4, speculative_tokens=3, debug_leaks=True) as engine:
                done = [await engine.generate(p, **kwargs) for p in prompts]
                stats = engine.stats()
        assert [d.token_ids for d in done] == ref
        for d in done:
            jsonschema.validate(json.loads(d.text), PERSON)
        assert stats["kv_blocks_used"] == 0
        if oracle:
            assert stats["num_accepted_draft_tokens"] > stats["num_draft_tokens"] / 2
            assert stats["num_masked_resamples"] > 0
