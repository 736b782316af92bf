"""lm-evaluation-harness against `tokenflow serve`: its `local-completions` model (echo + logprobs over
batches of token-id prompts) must give the log-likelihoods its `hf` model computes on the same weights,
on tasks built from local files (no hub)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.servers import Server

_WORDS = ("river stone light cloud bread market window garden letter winter horse silver "
          "song table mountain coffee paper engine forest ocean").split()


def _write_tasks(root: Path) -> Path:
    """Two tasks over local JSON lines: a multiple-choice one (log-likelihood of each choice after its
    context) and a perplexity one (rolling log-likelihood of whole documents)."""
    rng = random.Random(7)
    choice_docs = []
    for _ in range(12):
        question = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 30)))
        choice_docs.append({"question": question, "choices": [" " + rng.choice(_WORDS) for _ in range(4)],
                            "answer": rng.randrange(4)})
    text_docs = [{"text": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 80)))} for _ in range(6)]
    (root / "choices.jsonl").write_text("".join(json.dumps(d) + "\n" for d in choice_docs))
    (root / "texts.jsonl").write_text("".join(json.dumps(d) + "\n" for d in text_docs))
    (root / "local_choice.yaml").write_text(f"""task: local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "choices.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (root / "local_text.yaml").write_text(f"""task: local_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "texts.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: "{{{{text}}}}"
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""")
    return root


def _evaluate(model: str, model_args: dict[str, Any], tasks_dir: Path) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model, model_args=",".join(f"{k}={v}" for k, v in model_args.items()),
        tasks=["local_choice", "local_text"], task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )


def _loglikelihoods(result: dict[str, Any], task: str) -> list[float]:
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [float(r[0][0] if isinstance(r[0], (list, tuple)) else r[0]) for s in samples for r in s["resps"]]


def test_lm_eval_local_completions_match_its_hf_model(tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    tasks = _write_tasks(tmp_path)
    reference = _evaluate("hf", {"pretrained": tiny_model, "dtype": "float32", "device": "cpu",
                                 "batch_size": 4}, tasks)
    with Server(tiny_model, dtype="float32", max_num_seqs=8) as server:
        served = _evaluate("local-completions", {
            "model": "tiny-llama", "base_url": server.url + "/v1/completions", "tokenizer": tiny_model,
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "batch_size": 4,
            "num_concurrent": 2, "max_retries": 1, "max_length": 2048}, tasks)
    for task in ("local_choice", "local_text"):
        ours, theirs = _loglikelihoods(served, task), _loglikelihoods(reference, task)
        assert len(ours) == len(theirs) > 0
        assert ours == pytest.approx(theirs, abs=2e-3), task
    assert served["results"]["local_choice"]["acc,none"] == reference["results"]["local_choice"]["acc,none"]
    ppl = "word_perplexity,none"
    assert served["results"]["local_text"][ppl] == pytest.approx(reference["results"]["local_text"][ppl], rel=1e-3)
