"""The smallest server: tokenflow's OpenAI-compatible app, as is (what `tokenflow serve` runs).

    uvicorn examples.starlette_app:app --port 8000
    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
         -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}'
"""

from tokenflow.serve.openai_app import create_app

app = create_app("smollm2-135m", max_num_seqs=16)
