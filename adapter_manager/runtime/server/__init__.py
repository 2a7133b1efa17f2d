"""The HTTP server: OpenAI-compatible routes, adapter admin and vLLM routes, metrics endpoints (FastAPI, uvicorn)."""

from .app import BackgroundServer, create_app, serve
from .chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from .launch import Serving, build_serving
from .state import ServerConfig, ServerState

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "BackgroundServer",
    "ChatTemplate",
    "ChatTemplateError",
    "ServerConfig",
    "ServerState",
    "Serving",
    "build_serving",
    "create_app",
    "serve",
]
