"""The Serve application the end-to-end tests talk to: deployments.app on a local Ray of two CPUs,
served over HTTP on a free port, with the real embedded model."""
from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_plato(args: dict, decoder_replicas: int | None = None, decoder_options: dict | None = None) -> Iterator[str]:
    """Deploy the application built from `args` as "plato" at "/", with `decoder_replicas` Decoder
    replicas (None: as the deployment says) and any other `decoder_options` (Serve's deployment
    options); yields its base URL, and takes Serve and Ray down after."""
    ray = pytest.importorskip("ray")
    from ray import serve

    import deployments.app as app

    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        original = app.Decoder
        options = {**(decoder_options or {}), **({"num_replicas": decoder_replicas} if decoder_replicas else {})}
        if options:
            app.Decoder = original.options(**options)
        try:
            serve.run(app.build_app(args), name="plato", route_prefix="/", blocking=False)
        finally:
            app.Decoder = original
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
