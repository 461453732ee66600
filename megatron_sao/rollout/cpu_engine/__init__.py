"""A CPU rollout engine that speaks SGLang's native HTTP protocol.

`python -m megatron_sao.rollout.cpu_engine --model HF_DIR --port PORT` serves a transformers
causal LM with continuous batching, exact per-token log-probs, abort, pause / continue and
in-place weight updates, so that the agent loop, the engine client and the weight-sync code are
the same on CPU (tests, the demo) as against SGLang on GPU. See docs/rollout.md.
"""

from megatron_sao.rollout.cpu_engine.server import CPUEngine, CPUEngineConfig, ServerThread, create_app

__all__ = ["CPUEngine", "CPUEngineConfig", "ServerThread", "create_app"]
