"""`python -m megatron_sao.rollout.cpu_engine ...`: the old name of `python -m megatron_sao.cpu_engine`.

Runs the engine's own `__main__` in this process (same arguments, same exit code); run by module
name, not imported, so the library still imports nothing of `megatron_sao.cpu_engine`.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("megatron_sao.cpu_engine", run_name="__main__", alter_sys=True)
