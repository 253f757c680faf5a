"""`sift-serve`: SIFT behind OpenAI's completions and chat completions APIs, on Ray Serve or in one process.

    protocol.py   request bodies -> the engine's `Call`; chunks -> OpenAI's JSON and server-sent events
    render.py     chat messages -> prefix, documents, query, with the model's chat template
    worker.py     one engine replica: continuous batching over the engine's step API
    app.py        the FastAPI app (endpoints, streaming, disconnects, errors) over a backend
    metrics.py    Prometheus metrics
    routing.py    document-affinity routing (Ray Serve request router)
    deploy.py     the Ray Serve application
    cli.py        the `sift-serve` command

`import sift.runtime` never imports this package (nor FastAPI or Ray Serve).
"""
from .app import LocalBackend, build_app
from .config import ServeConfig
from .worker import EngineWorker

__all__ = ["build_app", "LocalBackend", "EngineWorker", "ServeConfig"]
