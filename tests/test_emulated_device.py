"""The emulated compute device (tests/emulated_device.py) refuses what CUDA refuses and nothing
else: its device rule against FakeTensorMode with real `device="cuda"` fake tensors, and its
collective check on a gloo world."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_sao.platform import run_distributed
from tests.emulated_device import EMULATED, EmulatedDeviceMismatch, emulated_compute_device, is_host

# Each case gets `d` (to the compute device) and `h` (leave on the host) and builds its tensors.
CASES = {
    "embedding with host indices": lambda d, h: F.embedding(h(torch.tensor([0, 1])), d(torch.ones(4, 2))),
    "embedding on the device": lambda d, h: F.embedding(d(torch.tensor([0, 1])), d(torch.ones(4, 2))),
    "index with host indices": lambda d, h: d(torch.ones(4))[h(torch.tensor([0, 2]))],
    "index_put with host indices": lambda d, h: d(torch.ones(4)).index_put_((h(torch.tensor([1])),), d(torch.zeros(1))),
    "add a host 0-dim tensor": lambda d, h: d(torch.ones(3)) + h(torch.tensor(2.0)),
    "add a host vector": lambda d, h: d(torch.ones(3)) + h(torch.ones(3)),
    "where with a Python scalar": lambda d, h: torch.where(d(torch.ones(3)) > 0, d(torch.ones(3)), 0.0),
    "copy host into device": lambda d, h: d(torch.zeros(3)).copy_(h(torch.ones(3))),
    "cat device and host": lambda d, h: torch.cat([d(torch.ones(3)), h(torch.ones(3))]),
    "in-place add of a host vector": lambda d, h: d(torch.ones(3)).add_(h(torch.ones(3))),
    "in-place add into a host vector": lambda d, h: h(torch.ones(3)).add_(d(torch.tensor(1.0))),
    "host vector plus device 0-dim": lambda d, h: h(torch.ones(3)) + d(torch.tensor(1.0)),
    "masked_fill with a host 0-dim value": lambda d, h: d(torch.ones(3)).masked_fill(d(torch.ones(3)) > 0,
                                                                                     h(torch.tensor(1.0))),
    "matmul with a host matrix": lambda d, h: d(torch.ones(2, 3)) @ h(torch.ones(3, 2)),
    "all on the host": lambda d, h: torch.stack([h(torch.ones(2)), h(torch.zeros(2))]).sum(),
}


def _refused_by_fake_cuda(case) -> bool:
    with FakeTensorMode():
        try:
            case(lambda t: t.to("cuda"), lambda t: t)
        except RuntimeError as error:
            assert "same device" in str(error), error
            return True
    return False


def _refused_by_emulation(case) -> bool:
    with emulated_compute_device(models=False):
        try:
            case(lambda t: t.to(EMULATED), lambda t: t)
        except EmulatedDeviceMismatch:
            return True
    return False


@pytest.mark.parametrize("name", list(CASES))
def test_refuses_what_fake_cuda_refuses(name):
    assert _refused_by_emulation(CASES[name]) == _refused_by_fake_cuda(CASES[name])


def test_stack_with_a_host_scalar_is_refused_as_cuda_does():
    """Stricter than FakeTensor, as CUDA is: `cat` (hence `stack`) has no `device_check: NoCheck`
    in native_functions.yaml, so its CUDA kernel checks every input's device, 0-dim ones too (the
    `_sums` of Python floats with a CUDA loss in training/steps.py hit this)."""
    def case(d, h):
        return torch.stack([d(torch.tensor(1.0)), h(torch.tensor(0.0))])

    assert _refused_by_emulation(case) and not _refused_by_fake_cuda(case)


def test_where_tensors_live_and_what_they_report():
    from megatron_sao.platform.device import compute_device

    with emulated_compute_device(models=False):
        assert compute_device() == EMULATED and torch.cuda.current_device() == EMULATED
        host, device = torch.zeros(2), torch.zeros(2, device=compute_device())
        assert is_host(host) and host.device == torch.device("cpu")
        assert not is_host(device) and device.device == EMULATED
        assert not is_host(torch.ones(2, device=device.device))  # `device=x.device` follows x
        assert not is_host(torch.zeros(2, device="cuda"))  # factories asking for CUDA get the compute device
        assert is_host(device.cpu()) and is_host(device.to("cpu")) and not is_host(host.to(EMULATED))
        assert is_host(torch.tensor([1.0])) and not is_host(torch.tensor([1.0], device=compute_device()))
        layer = torch.nn.Linear(2, 2)
        assert is_host(layer.weight)
        layer.to(compute_device())  # `param.data = moved` re-marks the parameter
        assert not is_host(layer.weight) and not is_host(layer(device))
        layer(device).sum().backward()
        assert not is_host(layer.weight.grad)
        assert not is_host(torch.zeros_like(device)) and is_host(torch.zeros_like(host))


def _collectives() -> dict[str, str]:
    import torch.distributed as dist

    from megatron_sao.platform import collective
    from megatron_sao.platform.device import compute_device

    out = {}
    with emulated_compute_device(models=False) as world:
        def attempt(name, fn):
            try:
                fn()
                out[name] = "ok"
            except EmulatedDeviceMismatch as error:
                out[name] = str(error)

        attempt("host all_reduce", lambda: dist.all_reduce(torch.ones(2)))
        attempt("device all_reduce", lambda: dist.all_reduce(torch.ones(2, device=compute_device())))
        gloo = dist.new_group([0], backend="gloo")
        attempt("host all_reduce on a gloo group", lambda: dist.all_reduce(torch.ones(2), group=gloo))
        attempt("object collective", lambda: collective.broadcast_object({"a": 1}))
        attempt("barrier", dist.barrier)
        attempt("any_rank_flags of host flags", lambda: collective.any_rank_flags(torch.ones(2, dtype=torch.int32)))
        attempt("sum_over_ranks of host counts", lambda: collective.sum_over_ranks(torch.ones(2, dtype=torch.int32)))
        attempt("any_rank", lambda: collective.any_rank(True))
        flags = torch.tensor([0, 1], dtype=torch.int32)
        out["flags stay on the host"] = str(is_host(collective.any_rank_flags(flags)) and flags.tolist() == [0, 1])
        attempt("broadcast_tensor", lambda: collective.broadcast_tensor(torch.ones(2), 0, (2,), torch.float32))
        out["collectives checked"] = str(world.collectives)
    return out


def test_collectives_refuse_host_tensors_on_accelerator_groups():
    out = run_distributed(_collectives, 1)[0]
    assert "No backend type associated with device type cpu" in out.pop("host all_reduce")
    assert int(out.pop("collectives checked")) >= 6
    assert out.pop("flags stay on the host") == "True"
    assert all(v == "ok" for v in out.values()), out
