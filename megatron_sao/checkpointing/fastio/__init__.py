"""Fast I/O for conversions: checkpoint reads and writes tuned to one host's costs, behind one switch.

Off by default. `sao convert hf-to-mcore|mcore-to-hf --fastio` (the requests' `fastio=True`)
turns all of it on; without it conversions use plain buffered reads and writes and torch's own
`FileSystemReader` for torch_dist loads. What both paths keep: memory bounded per rank (the shard
plus the I/O bucket), the completeness and exactness checks (NaN fill and check, manifests,
checksums of every file, the export guards) and atomic outputs.

Everything here was measured on this project's 2-core CI VM, where the page cache and the first
touch of fresh memory cost more CPU than the disk's bandwidth (docs/conversion.md#fast-io): O_DIRECT
reads and writes (`direct_io`), write-back started per item (`writeback`), pooled read buffers
(`read_buffers`), memory given back as soon as a parameter is written or exported (`page_release`)
with the load held a window ahead of the export (`load_window`), and torch_dist items read straight
into their parameters in one checksummed pass per file (`distcp_items`, `distcp_stream`,
`distcp_reader`). Whether any of it pays on a GPU node is not measured yet; until it is, it stays
off. Training never imports this package (tests/training/test_checkpoint_imports.py).

Nothing is imported here: `import megatron_sao.checkpointing.fastio` loads no I/O code.
"""
