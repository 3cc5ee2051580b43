"""Serving: many generation requests on a model registered once (docs/serving.md).

engine.py  the engine thread: continuous batching over flow/batch.SlotDecoder
api.py     OpenAI's completions API: requests checked, responses built
chat.py    OpenAI's chat completions API: messages through a chat template (Jinja2)
scoring.py log-probabilities, penalties and logit_bias
app.py     the HTTP application (Starlette), served by uvicorn (cli_serve.py)
middleware.py  its edges: the API key, request ids, CORS, timeouts (and uvicorn's protocol)
metrics.py Prometheus metrics
settings.py serve's settings and their defaults (the flags', stated once)
"""
