"""Run a CPU engine's HTTP server on a background thread of this process (tests, benchmarks, the demo)."""

from __future__ import annotations

import threading
import time

from megatron_sao.cpu_engine.server import CPUEngine, CPUEngineConfig, create_app


class ServerThread:
    """Run a CPU engine's uvicorn server on a background thread (tests, benchmarks, the demo).

    `with ServerThread(config) as server: ... server.url` — the engine is stopped on exit.
    """

    def __init__(self, config: CPUEngineConfig) -> None:
        import uvicorn

        self.engine = CPUEngine(config)
        self.app = create_app(self.engine)
        uv_config = uvicorn.Config(self.app, host=config.host, port=config.port, log_level="warning", lifespan="off",
                                   timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(uv_config)
        # A fatal error (what SGLang's scheduler crashes on) takes the server down, as in SGLang.
        self.engine.scheduler.on_fatal = lambda: setattr(self.server, "should_exit", True)
        self._thread = threading.Thread(target=self.server.run, name="cpu-engine-http", daemon=True)
        self.url = f"http://{config.host}:{config.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.engine.start()
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the CPU engine HTTP server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.engine.scheduler.request_stop()  # in-flight requests are answered (503) before the server goes
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.engine.stop()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
