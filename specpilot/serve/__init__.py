"""``specpilot serve``: an OpenAI-compatible HTTP server over the batched engine.

:mod:`.driver` owns the engine in one thread; :mod:`.app` is the FastAPI app (:mod:`.protocol` the request bodies
and what greedy decoding refuses, :mod:`.chat` the chat template, :mod:`.run` one request's flow, :mod:`.detok`
text from tokens, :mod:`.responses` OpenAI's response and stream shapes, :mod:`.metrics` Prometheus); :mod:`.cli`
the command.
"""
