"""The OpenAI-compatible HTTP server (`dspark serve`; needs `pip install dspark[server]`).

    dspark serve --model PATH --port 8000
    python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-'); \
print(c.completions.create(model='NAME', prompt='def add(a, b):', max_tokens=16).choices[0].text)"

Files: protocol.py (request bodies -> SamplingParams, errors), responses.py (response and
stream-chunk bodies), async_engine.py (the engine thread and per-request queues),
metrics.py (Prometheus), app.py (FastAPI routes), launch.py (build_engine, uvicorn),
commands.py (the CLI arguments), ray_backend.py (`--backend ray`: Ray Serve replicas) and
metrics_merge.py (their merged /metrics). Importing this package imports nothing heavy.
"""
