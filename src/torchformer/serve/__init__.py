"""`torchformer serve`: an OpenAI-compatible server with continuous batching over the static
KV cache. protocol.py (request checks, error envelope), responses.py + logprob_shapes.py
(response shapes), text.py (tokenizer, stop strings),
jobs.py + admission.py + engine.py + scheduler.py (one thread, slots = rows of one cache, the
queue and its capacity), rows.py (prefill and decode over rows), groups.py (a request's n
choices), logprobs.py, prefix.py (prefix caching), grammar.py (response_format: xgrammar's
token mask), embeddings.py + calls.py (/v1/embeddings for an encoder, run on the engine
thread), model_len.py (max-model-len: the cache's length, what fits in memory), metrics.py
(Prometheus), boundary.py (Host / Origin / body checks), app.py (ASGI routes, SSE), lifecycle.py
(the process: bounded shutdown). Needs the `serve` extra (starlette, uvicorn, jinja2, xgrammar);
nothing here is imported by `import torchformer`."""
