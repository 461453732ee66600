"""The Python tool sandbox: model-written code in an isolated, limited, short-lived process.

| module | what |
|---|---|
| `run` | `run_python`, `SandboxResult`: one call, supervised from the caller's side |
| `init` | the privileged half, run by path (`python -I -S -B .../init.py`), never imported by it |
| `config` | `SandboxConfig` (limits, uids, strict mode) |
| `pool` | `SandboxPool`, `run_python_async`: bounded concurrent calls for the agent loop |

Details and limits in docs/sandbox.md. The pool's names load on first use, so a one-shot caller
(the gateway's `sandbox_exec`) imports only the stdlib and `run`.
"""

from __future__ import annotations

from megatron_sao.rollout.sandbox.config import SandboxConfig
from megatron_sao.rollout.sandbox.run import SandboxResult, run_python
from megatron_sao.utils.lazy_exports import lazy_getattr

__all__ = ["SandboxConfig", "SandboxPool", "SandboxResult", "run_python", "run_python_async"]

__getattr__ = lazy_getattr(__name__, {"SandboxPool": "pool", "run_python_async": "pool"})
