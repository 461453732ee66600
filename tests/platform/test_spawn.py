from __future__ import annotations

import re

import pytest
import torch

from megatron_sao.platform import RankFailed, run_distributed
from megatron_sao.platform.spawn import RankUserError


def _all_reduce_rank() -> tuple[int, int, float]:
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t)


def _fail_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")


def test_ranks_communicate_over_gloo():
    assert run_distributed(_all_reduce_rank, 2) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_rank_failure_is_reported_with_traceback():
    """A rank's user error (ValueError) stays one: its own message, the traceback kept beside it."""
    with pytest.raises(RankUserError) as failed:
        run_distributed(_fail_on_rank_one, 2, timeout_s=120)
    assert isinstance(failed.value, RankFailed) and isinstance(failed.value, ValueError)
    assert str(failed.value) == "boom on rank one"
    assert re.search(r"rank 1 failed:(.|\n)*Traceback(.|\n)*boom on rank one", failed.value.tracebacks)


def _crash_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("a bug on rank one")


@pytest.mark.slow
def test_an_internal_error_on_a_rank_keeps_its_traceback():
    with pytest.raises(RankFailed, match=r"rank 1 failed:(.|\n)*RuntimeError: a bug on rank one") as failed:
        run_distributed(_crash_on_rank_one, 2, timeout_s=120)
    assert not isinstance(failed.value, ValueError)


def _backend() -> str:
    import torch.distributed as dist

    return dist.get_backend()


def test_backend_follows_the_machine():
    assert run_distributed(_backend, 1) == ["nccl" if torch.cuda.is_available() else "gloo"]


@pytest.mark.slow
def test_a_taken_rendezvous_port_is_retried_on_a_new_one(monkeypatch):
    """Another process binds the picked port before rank 0 does: the launch is repeated on a new
    port, and `fn` runs once."""
    import socket

    from megatron_sao.platform import distributed, spawn

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        ports = iter([squatter.getsockname()[1]])
        monkeypatch.setattr(spawn, "free_port", lambda: next(ports, None) or distributed.free_port())
        assert run_distributed(_all_reduce_rank, 1) == [(0, 1, 1.0)]
        assert next(ports, None) is None  # the taken port was tried first
