"""Start tokenflow on Ray Serve on a local Ray cluster, ask it over HTTP, shut it down.

    python plugins/tokenflow-ray/example.py                 # 2 replicas of smollm2-135m on port 8000
    python plugins/tokenflow-ray/example.py --tiny          # a tiny random-weight model: seconds, gibberish

Three conversations share a long system prompt and so land on the same replica,
whose prefix cache serves the later ones' prompt start; the answers print which
replica answered and how many prompt tokens came from its cache.
"""

import argparse
import json
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import ray
from ray import serve

from tokenflow_ray import build_app

# Longer than the router's key (the first 256 characters of the rendered conversation), so every
# conversation that starts with it goes to the same replica and reuses its cached KV.
SYSTEM = ("You are a concise assistant for a small travel agency in Lisbon. Answer every question in one short "
          "sentence. Name concrete places (cities, islands, parks, museums) rather than general advice. Never "
          "invent prices, opening hours or travel times; if the traveller needs them, tell them to check the "
          "official website. Prefer trains and buses over short flights.")


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tiny", action="store_true", help="use a tiny random-weight model instead")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    model: str | Path = args.model
    if args.tiny:
        from tokenflow.testing import build_tiny_model

        model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama")

    ray.init(include_dashboard=False)  # a local, single-node cluster
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        # num_cpus=0.5: two replicas fit on a 2-core laptop; give each a whole GPU with {"num_gpus": 1}.
        serve.run(build_app(model, num_replicas=args.replicas, ray_actor_options={"num_cpus": 0.5}))
        base = f"http://127.0.0.1:{args.port}/v1"
        questions = ["Where should I go for a weekend in Portugal?", "Which Greek island is best in May?",
                     "Where can I see glaciers in Europe?"]
        for question in questions:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            body = post(f"{base}/chat/completions", {"messages": messages, "max_tokens": 48, "temperature": 0})
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            print(f"[replica {body['replica_id']}, {cached:3d} cached prompt tokens] {question}\n"
                  f"    {body['choices'][0]['message']['content']!r}")
        for prompt in ("The capital of France is", "Rivers flow into"):
            body = post(f"{base}/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0})
            print(f"[replica {body['replica_id']}] {prompt!r} -> {body['choices'][0]['text']!r}")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
