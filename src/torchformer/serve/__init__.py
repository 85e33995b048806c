"""`torchformer serve`: an OpenAI-compatible server with continuous batching over the static
KV cache. protocol.py (request checks, error envelope), responses.py (response shapes), chat.py
(sandboxed chat templates), text.py (tokenizer, stop strings), jobs.py + admission.py +
engine.py (one thread, slots = rows of one cache, the queue and its capacity), model_len.py
(max-model-len: the cache's length, what fits in memory), metrics.py
(Prometheus), boundary.py (Host / Origin / body checks), app.py (ASGI routes, SSE), lifecycle.py
(the process: bounded shutdown). Needs the `serve` extra (starlette, uvicorn, jinja2); nothing
here is imported by `import torchformer`."""
