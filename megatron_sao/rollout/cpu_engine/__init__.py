"""The old module path of the CPU engine, kept for its documented command only.

The engine is its own package now, `megatron_sao.cpu_engine` (nothing in the library imports it;
it runs as its own process). `python -m megatron_sao.rollout.cpu_engine ...` still works: its
`__main__` runs `python -m megatron_sao.cpu_engine` with the same arguments. Import from
`megatron_sao.cpu_engine`.
"""
