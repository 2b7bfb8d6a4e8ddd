"""``specdec serve``: an OpenAI-compatible HTTP server on the continuous-batching :class:`~specdec_ext.Engine`.

* :mod:`~specdec_ext.serve.protocol`: request / response bodies, their checks, OpenAI-style errors;
* :mod:`~specdec_ext.serve.engine_loop`: the engine's own thread and each request's channel (:class:`EngineLoop`);
* :mod:`~specdec_ext.serve.metrics`: Prometheus metrics with vLLM's names;
* :mod:`~specdec_ext.serve.prompts`: prompt text and chat messages to token ids;
* :mod:`~specdec_ext.serve.app`: the FastAPI app (:func:`create_app`) and the uvicorn server that drains on SIGTERM;
* :mod:`~specdec_ext.serve.cli`: the ``specdec serve`` command.

Nothing is imported here: the server's packages (``pip install specdec_ext[serve]``) are needed only by the modules
that use them, so ``specdec`` runs without them.
"""
