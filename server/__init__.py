"""The HTTP server: OpenAI-compatible and SGLang-style routes over ``AsyncLLM``
(``dllm serve --model DIR`` or ``python -m dllm.server --model DIR``).

Modules: ``args`` (flags and ``ServerConfig``), ``protocol`` (request models and the error
shape), ``serving`` (validation and running requests, shared with ``dllm generate``),
``openai_api`` / ``native_api`` (the routes' logic), ``metrics``, ``middleware`` (auth, body
limit), ``app`` (FastAPI), ``launch`` (uvicorn), ``generate_cmd`` (``dllm generate``: one
prompt, or a JSONL file of OpenAI batch lines, through the same serving code in-process), and
``cli`` (the ``dllm`` command: it sits here, at the top of the import direction, because
``serve`` and ``generate`` run server code)."""
