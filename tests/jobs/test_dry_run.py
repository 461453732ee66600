"""`sao train RECIPE --dry-run` (and `sao sft`): every shipped recipe passes it, rank 0's trainer
built at the recipe's real shapes in a fake world holds what `sao plan` says it holds, and a bad
key, an impossible layout, a recipe that does not fit and an unbuilt feature each stop it with
the documented exit code and one line naming what is wrong."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sao.config import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").glob("*.yaml"))
PLAN_TOLERANCE = 0.01  # Megatron pads the vocabulary and the DDP buckets; the plan does not
ROLE_LINE = re.compile(r"^\s+(actor|critic)\s+parameters ([\d,]+) \(plan ([\d,]+)[^;]*; trainable ([\d,]+) "
                       r"\(plan ([\d,]+)[^;]*; optimizer shard ([\d,]+) \(plan ([\d,]+)", re.M)


BAD = {  # name -> (overrides of recipes/tiny_cpu.yaml, the key the one-line error must name)
    "unknown-key": (["parallelism.tensr=2"], "parallelism.tensr"),
    "tp-vs-world": (["parallelism.tensor=3"], "parallelism.tensor"),  # 3 does not divide the world of 2
    "ep-vs-experts": (["launcher.nproc_per_node=8", "parallelism.expert=8"], "parallelism.expert"),  # 4 experts
}
TOO_BIG = ("recipes/qwen3_30b_a3b_math_sao_1node_colocated.yaml", "launcher.gpu_type=h100-80g")


def _cases() -> list[tuple[str, list[str]]]:
    cases = [(f"train {r}", ["train", r, "--dry-run"]) for r in RECIPES]
    cases.append(("sft recipes/tiny_cpu.yaml", ["sft", "recipes/tiny_cpu.yaml", "--dry-run"]))
    cases += [(f"bad {name}", ["train", "recipes/tiny_cpu.yaml", *overrides, "--dry-run"])
              for name, (overrides, _) in BAD.items()]
    cases.append(("too big", ["train", *TOO_BIG, "--dry-run"]))
    return cases


CASES = _cases()


def _params() -> list:
    return [pytest.param(name, id=name.replace(" ", ":")) for name, _ in CASES if name.startswith(("train ", "sft "))]


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> dict[str, dict]:
    """Every case, one fresh process (imports once): name -> {code, seconds, out, err}."""
    out_dir = tmp_path_factory.mktemp("dry_run_walk")
    env = {**os.environ, "TMPDIR": str(out_dir), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    commands = [argv for _, argv in CASES]
    proc = subprocess.run([sys.executable, "-m", "tests.jobs.dry_run_walk", str(out_dir), json.dumps(commands)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out_dir / "results.json").read_text())
    print("dry-run walk (wall s, CPU s):", {name: (r["seconds"], r["cpu_seconds"])
                                             for (name, _), r in zip(CASES, results, strict=True)},
          f"total wall {sum(r['seconds'] for r in results):.1f} s, CPU {sum(r['cpu_seconds'] for r in results):.1f} s")
    return {name: {**r, "out": (out_dir / f"{i}.out").read_text(), "err": (out_dir / f"{i}.err").read_text()}
            for i, ((name, _), r) in enumerate(zip(CASES, results, strict=True))}


@pytest.mark.parametrize("name", _params())
def test_every_shipped_recipe_passes_the_dry_run(walk: dict[str, dict], name: str) -> None:
    result = walk[name]
    assert result["code"] == 0, f"exit {result['code']}: {result['err'].strip().splitlines()[-1:]}"
    assert "dry run ok" in result["out"]
    roles = ROLE_LINE.findall(result["out"])
    assert roles and roles[0][0] == "actor", result["out"]
    for role, *numbers in roles:
        built_params, plan_params, built_trainable, plan_trainable, built_optim, plan_optim = (
            int(n.replace(",", "")) for n in numbers)
        assert built_params == pytest.approx(plan_params, rel=PLAN_TOLERANCE), role
        assert built_trainable == pytest.approx(plan_trainable, rel=PLAN_TOLERANCE), role
        assert built_optim == pytest.approx(plan_optim, rel=PLAN_TOLERANCE), role


def test_sft_dry_run_builds_the_actor_alone(walk: dict[str, dict]) -> None:
    assert [role for role, *_ in ROLE_LINE.findall(walk["sft recipes/tiny_cpu.yaml"]["out"])] == ["actor"]
    assert [role for role, *_ in ROLE_LINE.findall(walk["train recipes/tiny_cpu.yaml"]["out"])] == ["actor", "critic"]


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_key_or_impossible_layout_exits_2_naming_the_key(walk: dict[str, dict], name: str) -> None:
    result, named = walk[f"bad {name}"], BAD[name][1]
    assert result["code"] == 2, result["err"][-2000:]
    last = result["err"].strip().splitlines()[-1]
    assert last.startswith("sao train: config error:") and named in last, last
    assert "dry run ok" not in result["out"]


def test_a_recipe_that_does_not_fit_exits_1_with_the_plan_verdict(walk: dict[str, dict]) -> None:
    result = walk["too big"]
    assert result["code"] == 1
    assert result["err"].strip().splitlines()[-1].startswith(
        "sao train: dry run: does not fit on h100-80g: trainer GPU needs"), result["err"][-2000:]
    assert "  build " not in result["out"]


def test_the_dry_run_refuses_what_the_trainer_refuses(monkeypatch, tmp_path: Path) -> None:
    """One function decides what is not built: patch it and both the trainer and the dry run refuse."""
    from megatron_sao.jobs.dry_run import dry_run
    from megatron_sao.training import features
    from megatron_sao.training.trainer import SaoTrainer

    monkeypatch.setattr(features, "unbuilt_features", lambda config, mode="rl": ["rollout.foo=1: not built"])
    config = load_config(ROOT / "recipes/tiny_cpu.yaml", [])
    with pytest.raises(NotImplementedError, match=r"rollout\.foo=1: not built"):
        SaoTrainer(config)
    with (tmp_path / "out.txt").open("w") as f, pytest.raises(NotImplementedError, match=r"rollout\.foo=1"):
        dry_run(config, str(ROOT / "recipes/tiny_cpu.yaml"), [], "rl", f)


def test_context_parallel_is_built() -> None:
    """Issue 29 built context parallelism: a CP recipe passes the trainer's feature check."""
    from megatron_sao.training.features import check_features_built, unbuilt_features

    config = load_config(ROOT / "recipes/tiny_cpu.yaml", ["parallelism.context=2"])
    assert unbuilt_features(config) == []
    check_features_built(config)
