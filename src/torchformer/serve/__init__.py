"""`torchformer serve`: an OpenAI-compatible server with continuous batching over the static
KV cache. protocol.py + errors.py (request checks, error envelope), responses.py +
logprob_shapes.py (response shapes), text.py (tokenizer, stop strings), jobs.py + admission.py +
engine.py + scheduler.py (one thread, slots = rows of one cache, the queue and its capacity),
rows.py (prefill and decode over rows), groups.py (a request's n choices), logprobs.py (with
generation/topk.py's blocked top-k and argmax), prefix.py (prefix caching), grammar.py (response_format: xgrammar's
token mask), tools.py + tool_formats.py + call_stream.py (tool calls: the request, the families'
formats, streaming them), embeddings.py + calls.py (/v1/embeddings for an encoder, run on the
engine thread), model_len.py (max-model-len: the cache's length, what fits in memory),
metrics.py (Prometheus), boundary.py (Host / Origin / body checks), app.py (ASGI routes),
delivery.py (engine events to the event loop, SSE), lifecycle.py (the process: bounded
shutdown). Needs the `serve` extra (starlette, uvicorn, jinja2, xgrammar); nothing here is
imported by `import torchformer`."""
