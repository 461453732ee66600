"""A compute device apart from host memory on a CPU-only machine: the device-discipline check.

On a GPU every tensor that feeds the model or an NCCL collective must be on the rank's CUDA
device; on CPU the host and the compute device are the same memory, so a tensor left on the host
goes unnoticed. `emulated_compute_device()` makes them two devices again while every op still
runs for real on the CPU (real values, data-dependent shapes, `.item()`, MoE token counts, real
gloo collectives), which FakeTensorMode cannot do for a whole train step:

- the compute device is `EMULATED = torch.device("cpu", 0)`: `platform.device.compute_device()`
  returns it, and so do `torch.cuda.current_device()` and factories asking for `device="cuda"`,
  as on a GPU rank; models megatron-bridge builds are moved there before they are wrapped, as
  bridge's `get_model` does on GPU (CPU initialisation skips that step);
- a tensor is HOST memory when it comes from a factory called from Python without tensor
  arguments and without the compute device (torch's default device is the host: every
  `torch.zeros(n)`), from Python data (`torch.tensor`, `from_numpy`: `aten.lift_fresh`) or a
  wrapped Python scalar, from `.cpu()` / `.to("cpu")`, or from an op whose known inputs are all
  host tensors. It is on the COMPUTE device when made there (`device=` the compute device,
  `.to(...)`) or computed from a compute tensor. A tensor made outside both (by C++ code, whose
  allocations pass the physical device, the CPU, whatever the tensor is for; by safetensors) is
  NOT KNOWN and takes no side in a check until an op computes a known tensor from it. The mark
  is an attribute of the tensor object, kept by a TorchDispatchMode (every aten op, forward and
  backward) and a TorchFunctionMode (`Tensor.device`, `.cpu()`, `.to()`, `.data = x`, Python
  factories);
- `Tensor.device` reports `EMULATED` for compute tensors, so `device=x.device` follows `x`;
- every aten op checks its tensor arguments as CUDA's kernels do (`check_device_rule`): the
  codegen'd device check (torchgen `RegisterDispatchKey.gen_device_check`: every tensor argument
  on one device) unless the op is `device_check: NoCheck` in the pinned torch's
  native_functions.yaml, where TensorIterator takes host 0-dim inputs as scalars; copies cross
  devices, and CUDA's index kernels take host indices. A violation raises
  `EmulatedDeviceMismatch`, worded like CUDA's "Expected all tensors to be on the same device";
- every collective on an accelerator group (made with the default backend: NCCL on GPU; a group
  asked for "gloo" explicitly is a CPU group on GPU too) refuses host tensors, as an NCCL-only
  group does (torch c10d: "No backend type associated with device type cpu"); object collectives
  stage through the compute device, as torch does for NCCL (`_get_object_coll_device`).

Not emulated: CUDA-only code paths (Transformer Engine, `torch.cuda.is_available()` branches)
still take their CPU side; streams and pinned memory; a tensor of unknown place (above) fed to
the model or a collective as it is: the project's batches, sums and flags are all made from
Python, and the checkpoint readers' tensors are copied into parameters.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

EMULATED = torch.device("cpu", 0)
HOST = torch.device("cpu")
_MARK = "_emulated_on_host"  # True: host memory, False: the compute device, absent: not known
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_COPIES = {"aten::_to_copy", "aten::copy_", "aten::copy", "aten::_copy_from", "aten::_copy_from_and_resize",
           "aten::set_"}
_HOST_SOURCES = {"aten::lift_fresh", "aten::lift_fresh_copy", "aten::scalar_tensor"}
# CUDA's index kernels move CPU index tensors to the device (ATen/native/TensorAdvancedIndexing.cpp).
_INDEX_OPS = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_", "aten::_unsafe_index",
              "aten::_unsafe_index_put"}


class EmulatedDeviceMismatch(RuntimeError):
    """A host tensor met a compute-device tensor where CUDA would refuse it."""


def where(tensor: torch.Tensor) -> bool | None:
    """True: host memory; False: the compute device; None: made outside the dispatcher and never
    placed since (e.g. by safetensors, or by C++ code): such a tensor takes no side in a check."""
    return getattr(tensor, _MARK, None)


def is_host(tensor: torch.Tensor) -> bool:
    return where(tensor) is True


def _mark(tensor: torch.Tensor, host: bool | None) -> None:
    if host is not None:
        setattr(tensor, _MARK, host)
    elif _MARK in tensor.__dict__:
        delattr(tensor, _MARK)


@functools.cache
def no_check_ops() -> frozenset[str]:
    """`aten::name.overload` of every op whose kernels skip the codegen'd device check
    (`device_check: NoCheck` in the pinned torch's native_functions.yaml)."""
    import torchgen

    path = Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"
    names, current = set(), None
    for line in path.read_text().splitlines():
        if line.startswith("- func:"):
            match = re.match(r"- func: ([\w.]+)\(", line)
            current = match.group(1) if match else None
        elif current and line.strip().startswith("device_check: NoCheck"):
            names.add("aten::" + current)
    return frozenset(names)


def _op_name(func: Any) -> tuple[str, str]:
    """(`aten::name`, `aten::name.overload`) of an OpOverload."""
    packet = f"{func.namespace}::{func._schema.name.split('::')[-1]}"
    overload = func._overloadname
    return packet, packet if overload == "default" else f"{packet}.{overload}"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def _device_kind(value: Any) -> bool | None:
    """For a device argument: True host, False the compute device, None neither (meta, absent)."""
    if value is None:
        return None
    device = torch.device(value) if not isinstance(value, torch.device) else value
    if device.type == "cuda" or device == EMULATED:
        return False
    if device.type == "cpu":
        return True
    return None


def check_device_rule(func: Any, args: tuple, kwargs: dict) -> bool | None:
    """Check an aten op's tensor arguments as a CUDA kernel would; return whether its outputs are
    host memory (None: leave them as they are).

    At this level a "cpu" device argument is ambiguous: C++ code (autograd formulas, kernels)
    passes the physical device of compute tensors, which is the CPU. So only `EMULATED` decides
    here; host allocations made from Python are marked by `_DeviceFunctionMode`, and Python data
    (`lift_fresh`) and wrapped Python scalars (`scalar_tensor`, CPU tensors on CUDA too) are host.
    """
    packet, name = _op_name(func)
    if packet in _HOST_SOURCES:
        return True
    schema = func._schema.arguments
    inputs: list[tuple[str, torch.Tensor, bool]] = []  # (argument, tensor, written)
    for i, value in enumerate(args):
        argument = schema[i] if i < len(schema) else None
        written = bool(argument is not None and argument.alias_info is not None and argument.alias_info.is_write)
        label = argument.name if argument is not None else str(i)
        if packet in _INDEX_OPS and label == "indices":
            continue  # host indices are fine for CUDA's index kernels
        inputs.extend((label, t, written) for t in _tensors(value) if t.device.type != "meta")
    by_name = {a.name: a for a in schema}
    for key, value in kwargs.items():
        argument = by_name.get(key)
        written = bool(argument is not None and argument.alias_info is not None and argument.alias_info.is_write)
        inputs.extend((key, t, written) for t in _tensors(value) if t.device.type != "meta")
    if kwargs.get("device") == EMULATED:
        return False  # a factory, `*_like`, `new_*` or `_to_copy` onto the compute device
    if packet in _COPIES:
        if packet == "aten::set_" and len(inputs) > 1:
            return where(inputs[1][1])
        return where(inputs[0][1]) if inputs else None  # copy_ keeps self; _to_copy (dtype) follows self
    if not inputs:
        return None  # a factory: host when called from Python (`_DeviceFunctionMode`), else not known
    host = [(n, t, w) for n, t, w in inputs if where(t) is True]
    compute = [(n, t, w) for n, t, w in inputs if where(t) is False]
    if not host or not compute:
        return True if host else False if compute else None
    if name in no_check_ops() and all(t.dim() == 0 and not w for _, t, w in host):
        return False  # TensorIterator: a host 0-dim input joins a device kernel as a scalar
    bad = host[0]
    raise EmulatedDeviceMismatch(
        f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
        f"({name}: argument {bad[0]!r} shape {tuple(bad[1].shape)} is host memory, argument "
        f"{compute[0][0]!r} is on the compute device)")


class _DeviceDispatchMode(TorchDispatchMode):
    """Checks every aten op and marks its new outputs host or compute."""

    def __init__(self, world: _World) -> None:
        super().__init__()
        self.world = world

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self.world.check_collective(func, args, kwargs)
            return func(*args, **kwargs)
        host = check_device_rule(func, args, kwargs)
        out = func(*args, **kwargs)
        if host is not None:
            # An op's outputs that are its own inputs (in-place, `out=`) keep their device; but
            # `lift_fresh` hands back its input and `set_` re-points it: those are (re)marked.
            relabels = _op_name(func)[0] in _COPIES or _op_name(func)[0] in _HOST_SOURCES
            inputs = {id(t) for v in (*args, *kwargs.values()) for t in _tensors(v)}
            for tensor in _tensors(out):
                if (relabels or id(tensor) not in inputs) and tensor.device.type != "meta":
                    _mark(tensor, host)
        return out


class _DeviceFunctionMode(TorchFunctionMode):
    """What the dispatcher cannot tell: the device tensors report, host allocations made from
    Python (a factory called without tensor arguments and without the compute device), host
    copies (`.cpu()`, `.to("cpu")`), `.data = x`, and factories asking for CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(kwargs.get("device"), (str, torch.device)) and torch.device(kwargs["device"]).type == "cuda":
            kwargs["device"] = EMULATED  # factories asking for CUDA get the compute device
        name = getattr(func, "__name__", "")
        if name == "__get__" and getattr(func, "__self__", None) is torch.Tensor.device:
            real = func(*args)
            return real if real.type != "cpu" or where(args[0]) is None else (HOST if is_host(args[0]) else EMULATED)
        if name == "__set__" and getattr(func, "__self__", None) is torch.Tensor.data:
            func(*args)
            _mark(args[0], where(args[1]))
            return None
        if func is torch.Tensor.cpu:
            return _host_copy(args[0])
        if func is torch.Tensor.cuda:
            return args[0].to(EMULATED, non_blocking=kwargs.get("non_blocking", False))
        if func is torch.Tensor.to:
            return _to(func, args, kwargs)
        out = func(*args, **kwargs)
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return out  # an aten op called directly (the dispatch mode's own calls): the dispatch mode decides
        if (isinstance(out, torch.Tensor) and out.device.type == "cpu"
                and not any(True for v in (*args, *kwargs.values()) for _ in _tensors(v))):
            _mark(out, _device_kind(kwargs.get("device")) is not False)  # a factory: host unless asked otherwise
        return out


def _to(func: Any, args: tuple, kwargs: dict) -> Any:
    other = args[1] if len(args) > 1 else kwargs.get("other")
    out = func(*args, **kwargs)
    if isinstance(other, torch.Tensor):
        wants_host = where(other)
    else:
        wants_host = _device_kind(torch._C._nn._parse_to(*args[1:], **kwargs)[0])
    if wants_host and not is_host(out):
        return _host_copy(out)
    if wants_host is False and where(out) is not False:
        return out.to(EMULATED)
    return out


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    if is_host(tensor) or tensor.device.type != "cpu":
        return tensor
    copy = tensor.detach().clone() if not tensor.requires_grad else tensor.clone()
    _mark(copy, True)
    return copy


class _World:
    """Which process groups are accelerator groups, and the collective check."""

    def __init__(self) -> None:
        self.cpu_groups: set[str] = set()
        self.collectives = 0

    def is_cpu_group(self, group: Any) -> bool:
        import torch.distributed as dist

        if group is None:
            return False
        if isinstance(group, torch.ScriptObject):
            group = dist.ProcessGroup.unbox(group)
        return getattr(group, "group_name", None) in self.cpu_groups

    def check_collective(self, func: Any, args: tuple, kwargs: dict) -> None:
        values = (*args, *kwargs.values())
        groups = [v for v in values if isinstance(v, torch.ScriptObject) and "ProcessGroup" in str(v)]
        if any(self.is_cpu_group(g) for g in groups):
            return
        self.collectives += 1
        for value in values:
            for tensor in _tensors(value):
                if is_host(tensor):
                    raise EmulatedDeviceMismatch(
                        f"{func}: a host tensor of shape {tuple(tensor.shape)} in a collective on an accelerator "
                        "group; an NCCL group has no CPU backend (No backend type associated with device type cpu)")


@contextlib.contextmanager
def emulated_compute_device(models: bool = True) -> Iterator[_World]:
    """Make `EMULATED` this rank's compute device and check every op and collective until exit
    (see the module docstring). Enter it after `init_distributed`, before building models.
    `models`: move the models megatron-bridge builds to the compute device before it wraps them,
    as it does on GPU (this imports megatron-bridge)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import megatron_sao.platform.device as platform_device

    world = _World()
    original_new_group, original_coll_device = dist.new_group, c10d._get_object_coll_device
    original_device = platform_device._COMPUTE_DEVICE

    def new_group(*args: Any, **kwargs: Any) -> Any:
        group = original_new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and str(backend).lower() == "gloo" and hasattr(group, "group_name"):
            world.cpu_groups.add(group.group_name)
        return group

    def object_coll_device(group: Any = None) -> Any:
        return "cpu" if world.is_cpu_group(group) else EMULATED

    original_parameter_new = torch.nn.Parameter.__new__

    def parameter_new(cls: type, data: torch.Tensor | None = None, requires_grad: bool = True) -> Any:
        # `Tensor._make_subclass` makes the parameter's object outside the dispatcher.
        param = original_parameter_new(cls, data, requires_grad)
        if isinstance(data, torch.Tensor):
            _mark(param, where(data))
        return param

    original_current_device = torch.cuda.current_device
    model_provider, original_get_model = None, None
    if models:
        from megatron_sao.models.bridge_compat import import_auto_bridge

        import_auto_bridge()  # megatron-bridge imports only through the project's TE-less shim here
        import megatron.bridge.models.model_provider as model_provider

        original_get_model = model_provider.get_model

    def get_model(*args: Any, pre_wrap_hook: Any = None, **kwargs: Any) -> Any:
        # bridge's get_model moves the chunks to `torch.cuda.current_device()` before wrapping them
        # (model_provider.py, "GPU allocation"), a step CPU initialisation skips: take it here.
        hooks = list(pre_wrap_hook) if isinstance(pre_wrap_hook, list) else [pre_wrap_hook] if pre_wrap_hook else []

        def to_compute_device(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
            for chunk in chunks:
                chunk.cuda(torch.cuda.current_device())
            return chunks

        return original_get_model(*args, pre_wrap_hook=[*hooks, to_compute_device], **kwargs)

    platform_device._COMPUTE_DEVICE = EMULATED
    if model_provider is not None:
        model_provider.get_model = get_model
    torch.cuda.current_device = lambda: EMULATED  # type: ignore[assignment]
    dist.new_group = new_group
    c10d._get_object_coll_device = object_coll_device
    torch.nn.Parameter.__new__ = parameter_new  # type: ignore[method-assign]
    try:
        with _DeviceFunctionMode(), _DeviceDispatchMode(world):
            yield world
    finally:
        dist.new_group, c10d._get_object_coll_device = original_new_group, original_coll_device
        torch.cuda.current_device = original_current_device
        if model_provider is not None:
            model_provider.get_model = original_get_model
        torch.nn.Parameter.__new__ = original_parameter_new  # type: ignore[method-assign]
        platform_device._COMPUTE_DEVICE = original_device
