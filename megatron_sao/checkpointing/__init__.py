"""HF <-> Megatron checkpoint conversion (megatron-bridge), torch_dist model checkpoints, manifests.

Entry points (imported from their modules, so `import megatron_sao.checkpointing` stays cheap):
- `hf_to_mcore.convert_hf_to_mcore` / `mcore_to_hf.convert_mcore_to_hf` / `verify.verify`:
  collective functions behind `sao convert {hf-to-mcore, mcore-to-hf, verify}` (`jobs/convert.py`);
- `keys.model_state`: the keys model weights are saved under, by conversion and training alike, so
  that converted checkpoints and training checkpoints are the same thing, in any layout (the one
  module of this package training uses for its weights);
- `mcore_io.save_model` / `mcore_io.load_model`: conversion's bounded-memory torch_dist save and
  in-place load under those keys;
- `manifest`: the checkpoint directory layout and its manifest;
- `hf_reader` / `dist_writer` / `dist_reader` / `hashing_file`: bounded-memory streaming I/O (HF
  read-ahead, the torch_dist writer and in-place loading, hashing files while writing them) within
  an I/O bucket (`io_bucket`);
- `fastio/`: the I/O tuned to the CI VM (O_DIRECT, memory given back, raw item reads), behind the
  conversions' `--fastio` switch, off by default.
See docs/conversion.md.
"""
