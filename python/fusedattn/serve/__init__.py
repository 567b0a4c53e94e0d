"""``fusedattn serve``: an OpenAI-compatible HTTP server for the engine's models
(aiohttp; the ``serve`` extra). ``make_app(engine, model_name, api_key)`` builds
the application; ``fusedattn.cli`` runs it."""

from .app import make_app, model_name

__all__ = ["make_app", "model_name"]
