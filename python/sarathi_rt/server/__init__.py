"""`sarathi-rt serve`: an OpenAI-compatible HTTP server on the async engine (FastAPI,
uvicorn and prometheus_client: the optional extra `sarathi_rt[serve]`)."""
from .app import OpenAIServer
from .draining import DrainingServer
from .protocol import Limits

__all__ = ["DrainingServer", "Limits", "OpenAIServer"]
