"""Worked programs built on megatron_sao, outside the library (nothing in `megatron_sao` imports them).

| package | what |
|---|---|
| `swe_agent` | the gateway's worked example: a SWE scaffold on `openai`, its tasks, verifier (docs/gateway.md) |

They run as `python -m examples.<package>.<module>` with the repository root on the import path
(`PYTHONPATH=.` from the root; `make demo-swe` sets it): the environment starts them in a fresh work
directory, where the root is not the current directory.
"""
