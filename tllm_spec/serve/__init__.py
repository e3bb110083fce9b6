"""OpenAI-compatible HTTP front end: ``tllm-spec serve`` runs a FastAPI app (``app.build_app``) under uvicorn,
with /v1/completions, /v1/chat/completions (JSON or server-sent events), /v1/models, /health and Prometheus
/metrics. It talks only to the engine's asyncio face (``SpecModel.async_engine``). Needs the ``serve`` extra
(``pip install tllm_spec[serve]``); ``import tllm_spec`` never imports it."""
