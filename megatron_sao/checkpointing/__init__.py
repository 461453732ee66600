"""HF <-> Megatron checkpoint conversion (megatron-bridge), torch_dist model checkpoints, manifests.

Entry points (imported from their modules, so `import megatron_sao.checkpointing` stays cheap):
- `hf_to_mcore.convert_hf_to_mcore` / `mcore_to_hf.convert_mcore_to_hf` / `verify.verify`:
  collective functions behind `sao convert {hf-to-mcore, mcore-to-hf, verify}` (`convert_cli`);
- `mcore_io.save_model` / `mcore_io.load_model`: how training writes and reads model weights, so
  that converted checkpoints and training checkpoints are the same thing, in any layout;
- `manifest`: the checkpoint directory layout and its manifest;
- `hf_reader` / `dist_writer` / `writeback`: bounded-memory streaming I/O (HF read-ahead, the
  torch_dist writer and in-place loading, hashing files while writing them) within an I/O bucket.
See docs/conversion.md.
"""
