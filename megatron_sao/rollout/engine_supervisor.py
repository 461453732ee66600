"""Starting, watching and restarting rollout engines.

`EngineSupervisor` starts `num_engines` servers, one process group each: real SGLang servers on GPU
(`python -m sglang.launch_server ...`, parallelism from `EngineConfig`) or the project's CPU
engine (`python -m megatron_sao.cpu_engine ...`). It waits for `/health_generate`,
and restarts an engine whose process died on the same host and port, so clients keep their URL;
the `EnginePool` stops routing to a dead engine and re-sends its in-flight calls elsewhere, then
routes to it again once it answers. A restarted engine starts from `model_path` at
`weight_version`; `set_weights()` moves both forward as the pipeline publishes checkpoints (an
engine refit from tensors or a process group needs the pipeline's `on_restart` callback to push
the current weights again). Engines end with the process that started them, however it ends
(utils/lifetime.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import httpx

from megatron_sao.utils.lifetime import start_child, stop_groups

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Rollout engines of one run (the lead wires this into the config tree)."""

    backend: Literal["cpu", "sglang"] = "cpu"
    """"sglang": SGLang servers on GPU; "cpu": the project's CPU engine (tests, the demo)."""
    model_path: str = ""
    """HF checkpoint directory the engines load at start (and at restart, see set_weights)."""
    num_engines: int = 1
    host: str = "127.0.0.1"
    base_port: int = 0
    """Engine i listens on base_port + i; 0 picks free ports at the first start."""
    weight_version: str = "0"
    """Initial weight version label: the integer policy version of model_path."""
    random_seed: int = 0
    """Engine i samples with seed random_seed + first_index + i."""
    first_index: int = 0
    """Index of engine 0 in the whole run (a supervisor of some of a run's engines, e.g. one per
    Ray actor): seeds and log file names follow the run-wide index."""
    tp_size: int = 1
    """SGLang tensor parallel size per engine."""
    ep_size: int = 1
    """SGLang expert parallel size (within the engine's TP group)."""
    dp_size: int = 1
    """SGLang data parallel replicas inside one engine (`--dp-size`, each a TP group of its own;
    0.5.23 refuses tensor / distributed weight updates unless it is 1, tokenizer_control_mixin.py)."""
    pp_size: int = 1
    attn_dp_size: int = 1
    """SGLang DP attention (`--attn-dp-size`, 0.5.23's replacement of the deprecated
    `--enable-dp-attention`, arg_groups/parallel_hook.py): attention data parallel inside the TP
    group, no extra GPUs; must divide tp_size."""
    base_gpu_id: int = 0
    """First GPU of engine 0; engine i starts at base_gpu_id + i * gpus_per_engine."""
    nnodes: int = 1
    """Nodes one engine spans (SGLang `--nnodes`); a supervisor with nnodes > 1 runs one node's part
    of one engine (platform/engine_nodes.py, pipeline/ray_engines.py)."""
    node_rank: int = 0
    """This part's node rank; only node rank 0 serves HTTP."""
    dist_init_addr: str = ""
    """HOST:PORT where the parts of a multi-node engine meet (node rank 0's address)."""
    mem_fraction_static: float | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    enable_memory_saver: bool = False
    """SGLang --enable-memory-saver (needed for release/resume_memory_occupation when colocated)."""
    trust_remote_code: bool = False
    extra_args: list[str] = field(default_factory=list)
    """Appended verbatim to every engine's command line."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the engine processes."""
    cpu_threads: int = 1
    """CPU engine: torch threads per engine."""
    cpu_dtype: str = "float32"
    startup_timeout_s: float = 600.0
    max_restarts: int = 3
    """Restarts per engine before the supervisor gives up on it."""
    log_dir: str | None = None
    """Engine i writes its output to log_dir/engine_{i}.log (None: inherit this process's)."""
    return_routed_experts: bool = False
    """Start engines with `--enable-return-routed-experts` (SGLang 0.5.23's server flag, which the
    CPU engine shares) so that requests asking for routed experts get them (routing replay)."""

    @property
    def gpus_per_engine(self) -> int:
        """GPUs of one engine on this node (all of them for an engine within one node)."""
        return self.tp_size * self.pp_size * self.dp_size // self.nnodes

    def validate(self) -> None:
        if self.backend not in ("cpu", "sglang"):
            raise ValueError(f"EngineConfig.backend must be 'cpu' or 'sglang', got {self.backend!r}")
        if not self.model_path:
            raise ValueError("EngineConfig.model_path is required")
        for name in ("num_engines", "tp_size", "ep_size", "dp_size", "pp_size", "attn_dp_size", "nnodes",
                     "cpu_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} must divide tp_size {self.tp_size} (SGLang's EP lives in TP)")
        if self.tp_size % self.attn_dp_size:
            raise ValueError(f"attn_dp_size {self.attn_dp_size} must divide tp_size {self.tp_size}")
        if (self.tp_size * self.pp_size * self.dp_size) % self.nnodes:
            raise ValueError(f"an engine of {self.tp_size * self.pp_size * self.dp_size} GPUs cannot span "
                             f"{self.nnodes} nodes evenly")
        if self.nnodes > 1 and (self.num_engines != 1 or not self.dist_init_addr or
                                not 0 <= self.node_rank < self.nnodes):
            raise ValueError("a multi-node engine part needs num_engines=1, dist_init_addr and 0 <= node_rank < nnodes")
        if self.backend == "cpu" and (self.gpus_per_engine != 1 or self.attn_dp_size != 1 or self.nnodes != 1):
            raise ValueError("the CPU engine has no tensor / pipeline / data parallelism; keep tp, pp, dp at 1")


@dataclass(slots=True)
class EngineHandle:
    index: int
    port: int
    url: str
    process: subprocess.Popen | None = None
    restarts: int = 0
    failed: bool = False
    log_file: IO[bytes] | None = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _repo_root() -> str:
    import megatron_sao

    return str(Path(megatron_sao.__file__).resolve().parent.parent)


class EngineSupervisor:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.engines: list[EngineHandle] = []
        self.on_restart: list[Callable[[EngineHandle], None]] = []
        self._model_path = config.model_path
        self._weight_version = config.weight_version
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def set_weights(self, model_path: str, weight_version: str) -> None:
        """Engines (re)started from now on load `model_path` labelled `weight_version`."""
        self._model_path, self._weight_version = model_path, weight_version

    # ---- commands ---------------------------------------------------------------------------

    def command(self, index: int, port: int) -> list[str]:
        """The command line of engine `index` listening on `port`."""
        c = self.config
        if c.backend == "cpu":
            return [
                sys.executable,
                "-m",
                "megatron_sao.cpu_engine",
                *("--model", self._model_path, "--host", c.host, "--port", str(port)),
                *("--weight-version", self._weight_version),
                *("--random-seed", str(c.random_seed + c.first_index + index)),
                *("--threads", str(c.cpu_threads), "--dtype", c.cpu_dtype),
                *(["--max-running-requests", str(c.max_running_requests)] if c.max_running_requests else []),
                *(["--enable-return-routed-experts"] if c.return_routed_experts else []),
                *c.extra_args,
            ]
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            *("--model-path", self._model_path, "--host", c.host, "--port", str(port)),
            *("--tp-size", str(c.tp_size), "--ep-size", str(c.ep_size)),
            *("--dp-size", str(c.dp_size), "--pp-size", str(c.pp_size)),
            *("--base-gpu-id", str(c.base_gpu_id + index * c.gpus_per_engine)),
            *("--weight-version", self._weight_version, "--random-seed", str(c.random_seed + c.first_index + index)),
            "--skip-server-warmup",
        ]
        if c.attn_dp_size > 1:
            cmd += ["--attn-dp-size", str(c.attn_dp_size)]
        if c.nnodes > 1:
            from megatron_sao.platform.engine_nodes import multi_node_args

            cmd += multi_node_args(c.nnodes, c.node_rank, c.dist_init_addr)
        if c.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(c.mem_fraction_static)]
        if c.context_length is not None:
            cmd += ["--context-length", str(c.context_length)]
        if c.max_running_requests is not None:
            cmd += ["--max-running-requests", str(c.max_running_requests)]
        if c.enable_memory_saver:
            cmd.append("--enable-memory-saver")
        if c.trust_remote_code:
            cmd.append("--trust-remote-code")
        if c.return_routed_experts:  # sglang/srt/arg_groups/fields/exec_.py: enable_return_routed_experts
            cmd.append("--enable-return-routed-experts")
        return cmd + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # Under torchrun this makes torch's tcp:// rendezvous a store client on every rank
        # (torch/distributed/rendezvous.py `_create_c10d_store`): an engine's weight update group
        # must not inherit it from the trainer.
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_repo_root(), env.get("PYTHONPATH", "")) if p)
        env.update(self.config.env)
        return env

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Start every engine and wait until all are healthy; returns their URLs."""
        if self.config.backend == "sglang" and importlib.util.find_spec("sglang") is None:
            raise ImportError(
                "EngineConfig.backend='sglang' needs the 'sglang' package (GPU machines; requirements-gpu.txt "
                "pins sglang==0.5.23). Use backend='cpu' on a CPU machine."
            )
        if self.engines:
            raise RuntimeError("the engines are already started")
        c = self.config
        for i in range(c.num_engines):
            port = c.base_port + i if c.base_port else free_port(c.host)
            self.engines.append(EngineHandle(index=i, port=port, url=f"http://{c.host}:{port}"))
        try:
            for handle in self.engines:
                self._spawn(handle)
            for handle in self.engines:
                self._wait_healthy(handle)
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _spawn(self, handle: EngineHandle) -> None:
        stdout: IO[bytes] | int | None = None
        if self.config.log_dir is not None:
            Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
            if handle.log_file is None:
                handle.log_file = open(self._log_path(handle), "ab")  # noqa: SIM115
            stdout = handle.log_file
        # A session of its own (stop() ends the engine's children too) that ends with this process
        # however it ends: the CPU engine watches us itself, SGLang's server runs under a keeper.
        handle.process = start_child(
            self.command(handle.index, handle.port),
            env=self.environment(),
            watches_parent=self.config.backend == "cpu",
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
        )
        logger.info("engine %d: pid %d on %s", handle.index, handle.process.pid, handle.url)

    def _wait_healthy(self, handle: EngineHandle) -> None:
        if self.config.nnodes > 1 and self.config.node_rank > 0:
            return  # serves no HTTP (0.5.23 http_server.py: node_rank >= 1 runs schedulers only)
        deadline = time.monotonic() + self.config.startup_timeout_s
        with httpx.Client(timeout=30.0) as http:
            while True:
                assert handle.process is not None
                if handle.process.poll() is not None:
                    raise RuntimeError(
                        f"engine {handle.index} exited with code {handle.process.returncode} while starting"
                        + (f"; see {self._log_path(handle)}" if self.config.log_dir else "")
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{handle.url}/health_generate").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine {handle.index} not healthy after {self.config.startup_timeout_s} s")
                time.sleep(0.25)

    def _log_path(self, handle: EngineHandle) -> Path:
        assert self.config.log_dir is not None
        return Path(self.config.log_dir) / f"engine_{self.config.first_index + handle.index}.log"

    def alive(self, index: int) -> bool:
        """Engine `index`'s process is running (it may still be starting, or hung)."""
        process = self.engines[index].process
        return process is not None and process.poll() is None

    def total_restarts(self) -> int:
        return sum(e.restarts for e in self.engines)

    def dead_engines(self) -> list[EngineHandle]:
        return [e for e in self.engines if not e.failed and e.process is not None and e.process.poll() is not None]

    def restart_dead(self) -> list[int]:
        """Restart every engine whose process exited; returns their indices. An engine past
        `max_restarts` is marked failed and left down."""
        restarted = []
        with self._lock:
            for handle in self.dead_engines():
                code = handle.process.returncode if handle.process else None
                if handle.restarts >= self.config.max_restarts:
                    logger.error("engine %d died (code %s) and is out of restarts", handle.index, code)
                    handle.failed = True
                    continue
                logger.warning("engine %d died (code %s); restarting on %s", handle.index, code, handle.url)
                handle.restarts += 1
                if handle.process is not None:  # children of the dead leader may still hold the port
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(handle.process.pid, signal.SIGKILL)
                self._spawn(handle)
                self._wait_healthy(handle)
                restarted.append(handle.index)
                for callback in self.on_restart:
                    callback(handle)
        return restarted

    def start_monitor(self, interval_s: float = 1.0) -> None:
        """Restart dead engines from a background thread every `interval_s`."""
        if self._monitor is not None:
            return
        self._monitor_stop.clear()

        def watch() -> None:
            while not self._monitor_stop.wait(interval_s):
                try:
                    self.restart_dead()
                except Exception:
                    logger.exception("engine restart failed")

        self._monitor = threading.Thread(target=watch, name="engine-monitor", daemon=True)
        self._monitor.start()

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to engine `index`'s process group (fault-injection in tests and drills)."""
        process = self.engines[index].process
        if process is not None and process.poll() is None:
            os.killpg(process.pid, sig)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the monitor and every engine (SIGTERM, then SIGKILL after `timeout_s`)."""
        self._monitor_stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=timeout_s)
            self._monitor = None
        with self._lock:
            stop_groups([h.process for h in self.engines if h.process is not None], timeout_s)
            for handle in self.engines:
                if handle.log_file is not None:
                    handle.log_file.close()
                    handle.log_file = None

    def __enter__(self) -> EngineSupervisor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
