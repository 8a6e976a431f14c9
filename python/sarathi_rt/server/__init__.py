"""`sarathi-rt serve`: an OpenAI-compatible HTTP server on the async engine (FastAPI +
uvicorn, the optional extra `sarathi_rt[serve]`)."""
from .app import OpenAIServer

__all__ = ["OpenAIServer"]
