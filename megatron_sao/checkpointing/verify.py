"""Does an mcore checkpoint compute what its HF counterpart computes? Compare outputs on a prompt.

Both sides run in float32 on the same token ids: the HF model with transformers (actor: logits of
`AutoModelForCausalLM`; critic: the base model's last hidden state through `score`), the Megatron
model built in the requested layout and loaded from the mcore checkpoint (TP outputs gathered,
the last pipeline stage's output broadcast). Reported: max-abs and mean-abs difference. The HF
model is never held whole: `hf_streamed` runs it unit by unit (embedding, each decoder layer, the
head), each rank reading and computing only its contiguous block of layers, so a rank needs one
layer's weights at a time (plus its Megatron shard) on 1 rank or N (torchrun / srun).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_sao.checkpointing.manifest import HF_DIR, check_files, read_manifest
from megatron_sao.checkpointing.mcore_io import load_model
from megatron_sao.checkpointing.model_setup import Layout, Role, build_for_conversion, conversion_config
from megatron_sao.models import critic_format as cf
from megatron_sao.models.hf_files import inspect_hf_checkpoint, read_config
from megatron_sao.platform.collective import broadcast_object, broadcast_tensor, raise_if_any, rank, world_size
from megatron_sao.platform.device import compute_device

DEFAULT_PROMPT = ("<|im_start|>user\nA train leaves at 9:40 and arrives at 13:05. How long is the trip?<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\n13:05 - 9:40 = 3 h 25 min.\n</think>\nThe trip takes 3 h 25 min.")


@dataclass(kw_only=True)
class VerifyRequest:
    hf_dir: Path
    mcore_dir: Path
    layout: Layout = field(default_factory=Layout)
    prompt: str = DEFAULT_PROMPT
    max_tokens: int = 64
    verify_checksums: bool = True
    """Check the mcore checkpoint's files against the manifest's SHA-256 sums before loading."""


@dataclass(kw_only=True)
class VerifyResult:
    role: Role
    num_tokens: int
    max_abs: float
    mean_abs: float

    def describe(self) -> str:
        what = "values" if self.role == "critic" else "logits"
        return (f"{what} over {self.num_tokens} tokens: max-abs difference {self.max_abs:.3e}, "
                f"mean-abs difference {self.mean_abs:.3e}")


def prompt_token_ids(hf_dir: Path, prompt: str, max_tokens: int, multiple: int = 8) -> torch.Tensor:
    """The prompt tokenised by the checkpoint's tokenizer, cut to a multiple of `multiple` tokens
    (sequence parallelism splits the sequence over TP ranks, context parallelism in 2 x CP chunks).
    Shape [1, T]."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(hf_dir))(prompt)["input_ids"][:max_tokens]
    ids = ids[: max(multiple, len(ids) - len(ids) % multiple)]
    if len(ids) < multiple:
        raise ValueError(f"the verification prompt is only {len(ids)} tokens; give a longer --prompt")
    return torch.tensor([ids], dtype=torch.long)


def forward_outputs(chunks: list[torch.nn.Module], tokens_bt: torch.Tensor) -> torch.Tensor:
    """Collective: the model's full output [B, T, V] (actor) or [B, T, 1] (critic) on every rank,
    on the host (where the HF reference is computed); the model runs on the compute device. Under
    context parallelism each rank runs its chunks of the sequence and the outputs are gathered."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_sao.models.outputs import position_ids_for
    from megatron_sao.platform.context_parallel import cp_group, gather_sequence, split_sequence

    tokens_bt = tokens_bt.to(compute_device())
    local = split_sequence({"ids": tokens_bt, "positions": position_ids_for(tokens_bt)}, cp_group())
    tokens_bt, positions, mask = local["ids"], local["positions"], None  # causal by the layers' mask type
    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            out = chunks[0](tokens_bt, positions, mask)
        else:
            def step(data_iterator, model):
                return model(tokens_bt, positions, mask), lambda x, non_loss_data=False: x

            results = get_forward_backward_func()(
                forward_step_func=step, data_iterator=[iter([None]) for _ in chunks], model=chunks,
                num_microbatches=1, seq_length=tokens_bt.shape[1] * parallel_state.get_context_parallel_world_size(),
                micro_batch_size=tokens_bt.shape[0],
                forward_only=True, collect_non_loss_data=True)
            group = parallel_state.get_pipeline_model_parallel_group()
            last = torch.distributed.get_global_rank(group, torch.distributed.get_world_size(group) - 1)
            out = results[0] if parallel_state.is_pipeline_last_stage() else None
            out = _broadcast_tensor(out, last, group)
        if out.shape[-1] != 1 and parallel_state.get_tensor_model_parallel_world_size() > 1:
            out = gather_from_tensor_model_parallel_region(out)
        out = gather_sequence(out, cp_group())
    return out.float().cpu()


def _broadcast_tensor(tensor: torch.Tensor | None, src: int, group: object) -> torch.Tensor:
    meta = [None if tensor is None else (tuple(tensor.shape), tensor.dtype)]
    torch.distributed.broadcast_object_list(meta, src=src, group=group)
    shape, dtype = meta[0]
    return broadcast_tensor(tensor, src, shape, dtype, group=group, device=compute_device())


def streamed_hf_outputs(hf_dir: Path, tokens_bt: torch.Tensor) -> tuple[Role, torch.Tensor]:
    """Collective: what `hf_outputs` computes, streamed and sharded over the ranks (`hf_streamed`);
    the same on every rank."""
    from safetensors import safe_open

    from megatron_sao.checkpointing.hf_streamed import StreamedHFModel

    config = read_config(hf_dir)
    if not cf.is_critic_config(config):
        return "actor", StreamedHFModel(hf_dir).forward(tokens_bt)
    with tempfile.TemporaryDirectory() as tmp:
        view = cf.causal_view(hf_dir, config, Path(tmp) / "hf")
        hidden = StreamedHFModel(hf_dir, config_dir=view, base=True).forward(tokens_bt)
    tensors = inspect_hf_checkpoint(hf_dir).tensors
    head = {}
    for name in (cf.VALUE_WEIGHT, cf.VALUE_BIAS):
        if name in tensors:
            with safe_open(str(hf_dir / tensors[name].file), framework="pt") as f:
                head[name] = f.get_tensor(name).float()
    return "critic", torch.nn.functional.linear(hidden, head[cf.VALUE_WEIGHT], head.get(cf.VALUE_BIAS))


def hf_outputs(hf_dir: Path, tokens_bt: torch.Tensor) -> tuple[Role, torch.Tensor]:
    """The HF checkpoint's float32 output on `tokens_bt`: logits (actor) or values [B, T, 1] (critic),
    from the whole model loaded by transformers on this rank (the reference `streamed_hf_outputs`
    is tested against; small checkpoints only)."""
    import transformers
    from safetensors import safe_open

    config = read_config(hf_dir)
    with torch.no_grad():
        if not cf.is_critic_config(config):
            model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
            return "actor", model(tokens_bt).logits.float()
        with tempfile.TemporaryDirectory() as tmp:
            view = cf.causal_view(hf_dir, config, Path(tmp) / "hf")
            trunk = transformers.AutoModel.from_pretrained(str(view), dtype=torch.float32).eval()
            hidden = trunk(tokens_bt).last_hidden_state.float()
        tensors = inspect_hf_checkpoint(hf_dir).tensors
        head = {}
        for name in (cf.VALUE_WEIGHT, cf.VALUE_BIAS):
            if name in tensors:
                with safe_open(str(hf_dir / tensors[name].file), framework="pt") as f:
                    head[name] = f.get_tensor(name).float()
        return "critic", torch.nn.functional.linear(hidden, head[cf.VALUE_WEIGHT], head.get(cf.VALUE_BIAS))


def mcore_outputs(mcore_dir: Path, tokens_bt: torch.Tensor, layout: Layout,
                  verify_checksums: bool = True) -> tuple[Role, torch.Tensor]:
    """Collective: build the checkpoint's model in float32 in `layout`, load it, run `tokens_bt`."""
    manifest = read_manifest(mcore_dir)
    check_files(mcore_dir, manifest, verify_hashes=verify_checksums)
    with tempfile.TemporaryDirectory() as tmp:
        view = cf.causal_view(mcore_dir / HF_DIR, read_config(mcore_dir / HF_DIR), Path(tmp) / "hf")
        config = conversion_config(view, layout, world_size(), torch.float32)
        chunks = build_for_conversion(config, manifest.role)  # type: ignore[arg-type]
    load_model(chunks, mcore_dir)
    return manifest.role, forward_outputs(chunks, tokens_bt)  # type: ignore[return-value]


def verify(request: VerifyRequest) -> VerifyResult:
    """Collective: compare HF and Megatron outputs; the result is the same on every rank."""
    layout = request.layout
    # Sequence parallelism splits a CP rank's share over TP; CP cuts the sequence in 2 x CP chunks.
    multiple = math.lcm(8, 2 * layout.cp * layout.tp)
    tokens = prompt_token_ids(Path(request.hf_dir), request.prompt, request.max_tokens, multiple)
    role, megatron = mcore_outputs(Path(request.mcore_dir), tokens, request.layout, request.verify_checksums)
    hf_role, reference = streamed_hf_outputs(Path(request.hf_dir), tokens)
    result, errors = None, []
    if rank() == 0:
        if hf_role != role:
            errors.append(f"{request.hf_dir} is an {hf_role} checkpoint, {request.mcore_dir} a {role} one")
        else:
            diff = (megatron[..., : reference.shape[-1]] - reference).abs()
            result = VerifyResult(role=role, num_tokens=tokens.shape[1], max_abs=diff.max().item(),
                                  mean_abs=diff.mean().item())
    raise_if_any(errors)
    return broadcast_object(result)
