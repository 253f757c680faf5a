"""`sift-serve`: an OpenAI-compatible server over a SIFT index.

    sift-serve INDEX [--model M] [--host 127.0.0.1] [--port 8000] [--mode sift|reuse|hybrid|dense]
               [--kv-hbm-gib G] [--kv-dram-gib G] [--replicas N] [--max-queue N] [--ray-address ADDR]

With Ray Serve (the default): one engine replica per GPU of the cluster (one CPU replica where there is none;
`--replicas N` to choose), document-affinity routing between them, on a local Ray or the cluster at
`--ray-address` / $RAY_ADDRESS. `--replicas 0` serves from this process alone, without Ray (one engine: the
fastest start, and all a single-GPU machine needs). The server runs until SIGINT or SIGTERM.

Exit codes: 0 stopped by a signal, 2 could not start (bad index, model or option; one line on stderr).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback

import click

from sift.errors import SiftError, one_line

from .config import MODES, ServeConfig

EXIT_OK, EXIT_ERROR = 0, 2


def _fail(message: str) -> None:
    click.echo(f"error: {' '.join(message.splitlines())}", err=True)
    sys.exit(EXIT_ERROR)


def _index_model(index: str) -> str:
    """The model the index was built with (its manifest; checksums are verified by the replicas)."""
    from sift.format import IndexReader

    return IndexReader.open(index, verify=False).manifest.model.name


def serve_local(cfg: ServeConfig, host: str, port: int, echo) -> None:
    """One engine in this process, behind uvicorn (no Ray)."""
    import uvicorn

    from .app import LocalBackend, build_app
    from .config import make_worker, tune_process
    from .render import ChatRenderer

    tune_process()
    worker, tokenizer, name = make_worker(cfg)
    renderer = ChatRenderer(tokenizer) if getattr(tokenizer, "chat_template", None) else None
    app = build_app(LocalBackend(worker), model=name, defaults=cfg.defaults, renderer=renderer)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           lifespan="off"))
    echo(f"sift-serve: serving {name} (mode {cfg.mode}) from {cfg.index} at http://{host}:{port}/v1 "
         f"(one engine in this process)")
    # uvicorn shuts down on SIGINT / SIGTERM, then re-raises the signal to the handler it found: this one, which
    # lets run() return so that the engine is closed and the exit code is 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        worker.close()
    echo("sift-serve: stopped")


def serve_ray(cfg: ServeConfig, host: str, port: int, replicas: int | None, ray_address: str | None,
              verbose: bool, echo) -> None:
    import ray
    from ray import serve

    from .deploy import APP, serve_app

    name = cfg.model or _index_model(cfg.index)
    address = ray_address or os.environ.get("RAY_ADDRESS")
    chatter = dict(log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.ERROR)
    started = not ray.is_initialized()
    if started:
        if address:
            ray.init(address=address, **chatter)
        else:
            ray.init(include_dashboard=False, **chatter)
    try:
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        if replicas is None:
            replicas = gpus or 1
        per_cpu = max(1, int(resources.get("CPU", 1)) // replicas) if not gpus else 1
        if gpus and replicas > gpus:
            raise SiftError(f"--replicas {replicas} but the cluster has {gpus} GPUs: one engine replica per GPU")
        serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": verbose})
        serve.run(serve_app(cfg, name, replicas, gpus > 0, per_cpu), name=APP, route_prefix="/", blocking=False)
        where = "GPU" if gpus else f"CPU ({per_cpu} cores)"
        echo(f"sift-serve: serving {name} (mode {cfg.mode}) from {cfg.index} at http://{host}:{port}/v1 "
             f"({replicas} engine replica{'s' if replicas > 1 else ''}, one {where} each, Ray Serve)")
        _wait_for_signal()
        echo("sift-serve: stopping")
    finally:
        try:
            serve.shutdown()
        finally:
            if started:
                ray.shutdown()


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("index")
@click.option("--model", default=None, help="The served model (default: the index's model).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--mode", default="sift", show_default=True,
              help=f"Engine mode of requests that name none ({', '.join(MODES)}; hybrid:<policy>[@<f>]).")
@click.option("--kv-hbm-gib", type=float, default=None,
              help="KV store pool per replica (default: half the GPU memory free after loading; 1 GiB on CPU).")
@click.option("--kv-dram-gib", type=float, default=0.0, show_default=True, help="Pinned DRAM tier per replica.")
@click.option("--replicas", type=int, default=None,
              help="Engine replicas (default: one per GPU, else one on CPU; 0: this process alone, no Ray).")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Requests waiting per replica before 503.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Per-request timeout (s).")
@click.option("--max-tokens-default", type=int, default=256, show_default=True,
              help="max_tokens of a chat request that gives none.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="auto (bfloat16 on CUDA, float32 on CPU) or a dtype.")
@click.option("--ray-address", default=None, help="Existing Ray cluster (default: $RAY_ADDRESS, else a local Ray).")
@click.option("-v", "--verbose", is_flag=True, help="Ray's logs and the access log too.")
def main(index, model, host, port, mode, kv_hbm_gib, kv_dram_gib, replicas, max_queue, timeout_s, max_tokens_default,
         device, dtype, ray_address, verbose):
    """Serve INDEX (a folder or a URI) over OpenAI's completions and chat completions APIs."""
    def echo(line: str) -> None:
        click.echo(line, err=True)

    try:
        cfg = ServeConfig(index=index, model=model, mode=mode, kv_hbm_gib=kv_hbm_gib, kv_dram_gib=kv_dram_gib,
                          max_queue=max_queue, timeout_s=timeout_s, device=device, dtype=dtype,
                          max_tokens_chat=max_tokens_default)
        if replicas is not None and replicas < 0:
            raise SiftError(f"--replicas {replicas} must be >= 0")
        if replicas == 0:
            serve_local(cfg, host, port, echo)
        else:
            serve_ray(cfg, host, port, replicas, ray_address, verbose, echo)
    except SiftError as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - one line, exit 2 (traceback with SIFT_DEBUG=1)
        if os.environ.get("SIFT_DEBUG"):
            traceback.print_exc()
        _fail(f"{one_line(e)} (the server did not start; SIFT_DEBUG=1 shows the traceback)")
    sys.exit(EXIT_OK)
