"""Megatron training pieces: DDP + optimizer construction and the pipeline-aware step runner.

The SAO trainer (critic and actor steps, batch packing) builds on these.
"""
