"""A gateway (or any ASGI app) served by uvicorn on a thread of its own, with its own event loop."""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from journeyman.errors import BackendError
from journeyman.records import register_in_process, unregister_in_process

from .record_log import RecordLog
from .vllm_config import free_port

__all__ = ["GatewayThread"]


class HasApp(Protocol):
    """What the thread serves: an object with an ASGI ``app`` (a :class:`~.gateway.Gateway`; when it
    has a :class:`RecordLog` as ``records``, tracers in this process read it directly)."""

    @property
    def app(self) -> Any: ...


class GatewayThread:
    """Runs a gateway with uvicorn on a thread of its own (its own event loop).

    While it runs, tracers in this process that point at its URL read its records directly
    (``journeyman.records.in_process_records``) instead of over HTTP.
    """

    def __init__(
        self,
        gateway: HasApp,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        shutdown_timeout: int = 10,
        name: str = "gateway",
    ) -> None:
        import uvicorn

        self.gateway = gateway
        self.name = name
        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(
            gateway.app,
            host=host,
            port=self.port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=shutdown_timeout,  # requests still running then are cut off
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"journeyman-{name}", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> GatewayThread:
        if self._thread.is_alive():
            return self
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise BackendError(f"the {self.name} did not start on {self.base_url} (port in use?)")
            time.sleep(0.02)
        if isinstance(records := getattr(self.gateway, "records", None), RecordLog):
            register_in_process(self.base_url, records)
        return self

    def stop(self) -> None:
        if isinstance(records := getattr(self.gateway, "records", None), RecordLog):
            unregister_in_process(self.base_url, records)
        self._server.should_exit = True
        self._thread.join()

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
