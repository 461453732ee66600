"""A CPU rollout engine that speaks SGLang's native HTTP protocol.

`python -m megatron_sao.cpu_engine --model HF_DIR --port PORT` serves a transformers
causal LM with continuous batching, exact per-token log-probs, abort, pause / continue and
in-place weight updates, so that the agent loop, the engine client and the weight-sync code are
the same on CPU (tests, the demo) as against SGLang on GPU. It accepts SGLang 0.5.23's whole
`/generate` request surface (streaming, `n`, stops and `stop_regex`, penalties, prompt / top-k /
token-id log-probs) and refuses, naming the field, what a CPU engine cannot do (constrained
decoding, LoRA, multimodal input). See docs/rollout.md.
"""

from megatron_sao.cpu_engine.server import CPUEngine, CPUEngineConfig, create_app
from megatron_sao.cpu_engine.server_thread import ServerThread

__all__ = ["CPUEngine", "CPUEngineConfig", "ServerThread", "create_app"]
