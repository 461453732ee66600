"""`sao launch slurm --dry-run`: a script for every shipped recipe, parsed by bash, with the
choices the flags and the recipe make; and the helpers the job runs inside Slurm."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megatron_sao.cli import main
from megatron_sao.platform.ray_cluster import check_nodes, worker_port_range
from megatron_sao.platform.slurm import expand_hostlist, job_port_block, node_ip, parse_port_range
from megatron_sao.platform.slurm_job import check_container_paths
from megatron_sao.rollout.trajectory_io import write_parquet
from tests.training.trajectories import random_trajectories

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    """The files a launch checks for, on the "shared file system": recorded trajectories, a prompt
    file; the scale recipes' model directories hold only config.json, so they start from random
    weights here (model.load_weights=false)."""
    root = tmp_path_factory.mktemp("launch_inputs")
    write_parquet(root / "recorded.parquet", random_trajectories(4, seed=3))
    (root / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    return (f"data.trajectories_path={root / 'recorded.parquet'}", f"data.train_path={root / 'prompts.jsonl'}",
            "model.load_weights=false")


def _dry_run(recipe: Path, tmp_path: Path, *flags: str, overrides: tuple[str, ...] = (),
             inputs: tuple[str, ...] = ()) -> str:
    assert main(["launch", "slurm", str(recipe), f"run.output_dir={tmp_path}", *inputs, *overrides, "--dry-run",
                 *flags]) == 0
    script = next(tmp_path.glob("*/launch/dry-run/sao_job.sbatch"))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    return script.read_text()


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_dry_runs_to_a_bash_script(recipe: Path, tmp_path: Path, inputs: tuple[str, ...],
                                                capfd: pytest.CaptureFixture[str]) -> None:
    text = _dry_run(recipe, tmp_path, inputs=inputs)
    assert f"sbatch script: {tmp_path}" in capfd.readouterr().out
    assert "#SBATCH --signal=B:USR1@120" in text and "checkpoint.resume=auto" in text
    assert "{{" not in text


def test_flags_map_onto_sbatch_lines(tmp_path: Path, inputs: tuple[str, ...]) -> None:
    text = _dry_run(RECIPES / "qwen3_30b_a3b_math_sao.yaml", tmp_path, "--nodes", "12", "--partition", "gpu",
                    "--account", "proj", "--time", "02:00:00", "--requeue", "--gpus-per-node", "4", inputs=inputs)
    for line in ("--nodes=12", "--partition=gpu", "--account=proj", "--time=02:00:00", "--requeue",
                 "--gpus-per-node=4"):
        assert f"#SBATCH {line}\n" in text
    config = (tmp_path / "qwen3_30b_a3b_math_sao" / "launch" / "dry-run" / "config.yaml").read_text()
    assert "nnodes: 12" in config and "kind: slurm" in config


def test_container_paths_are_checked_before_submission(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such image file"):
        check_container_paths({}, [tmp_path], str(tmp_path / "missing.sqsh"))
    (tmp_path / "m").mkdir()
    with pytest.raises(ValueError, match="not under any container mount"):
        check_container_paths({"model.hf_path": tmp_path / "m"}, [tmp_path / "other"], "nvcr.io/x:1")
    with pytest.raises(ValueError, match="does not exist"):
        check_container_paths({"model.hf_path": tmp_path / "gone"}, [tmp_path], "nvcr.io/x:1")
    check_container_paths({"model.hf_path": tmp_path / "m"}, [tmp_path], "nvcr.io/x:1")


def test_container_launch_runs_steps_in_the_image(tmp_path: Path, inputs: tuple[str, ...]) -> None:
    image = tmp_path / "sao.sqsh"
    image.write_bytes(b"")
    text = _dry_run(RECIPES / "qwen3_30b_a3b_math_sao.yaml", tmp_path, "--container", str(image), inputs=inputs)
    assert f"--container-image={image}" in text and "--container-mounts=" in text


def test_hostlist_expansion() -> None:
    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("node1") == ["node1"]
    assert expand_hostlist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]


def test_port_blocks_differ_between_neighbouring_jobs() -> None:
    blocks = [job_port_block(j, (20000, 29999)) for j in range(100, 700)]
    firsts = [b.first for b in blocks]
    assert len(set(firsts)) == len(firsts)
    assert all(b.first >= 20000 and b.first + b.count - 1 <= 29999 for b in blocks)
    assert len({worker_port_range(b) for b in blocks}) == len(blocks)
    with pytest.raises(ValueError):
        parse_port_range("30000")


def test_node_ip_never_silently_advertises_loopback() -> None:
    with pytest.raises(ValueError, match="only to loopback"):
        node_ip(hostname="localhost")
    assert node_ip(hostname="localhost", allow_loopback=True).startswith("127.")
    with pytest.raises(ValueError, match="no network interface"):
        node_ip(interface="does-not-exist0")


def test_join_barrier_names_what_is_missing() -> None:
    node = {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0, "GPU": 8.0}}
    weak = {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0, "GPU": 4.0}}
    assert check_nodes([node, {**node, "NodeManagerAddress": "10.0.0.3"}], 2, 8, 8) is None
    assert "1 of 2 nodes joined (10.0.0.1)" in check_nodes([node], 2, 8, 8)
    assert "10.0.0.2 has CPU=8 GPU=4" in check_nodes([node, weak], 2, 8, 8)


def test_launcher_fields_come_from_the_recipe_and_flags_override_them(tmp_path: Path,
                                                                     inputs: tuple[str, ...]) -> None:
    text = _dry_run(RECIPES / "qwen3_30b_a3b_math_sao.yaml", tmp_path, "--interface", "ib0", "--port-range",
                    "40000-40999", "--join-timeout", "77", "--requeue", inputs=inputs)
    assert "NET_IFACE=ib0\n" in text and "PORT_RANGE=40000-40999\n" in text and "JOIN_TIMEOUT=77\n" in text
    assert "REQUEUE=1\n" in text and "#SBATCH --requeue\n" in text
    config = (tmp_path / "qwen3_30b_a3b_math_sao" / "launch" / "dry-run" / "config.yaml").read_text()
    assert "network_interface: ib0" in config and "join_timeout_s: 77" in config and "requeue: true" in config
    recipe_only = _dry_run(RECIPES / "qwen3_30b_a3b_math_sao.yaml", tmp_path / "b", inputs=inputs,
                           overrides=("launcher.port_range=41000-41999", "launcher.join_timeout_s=12"))
    assert "PORT_RANGE=41000-41999\n" in recipe_only and "JOIN_TIMEOUT=12\n" in recipe_only
    assert "REQUEUE=0\n" in recipe_only and "#SBATCH --no-requeue\n" in recipe_only


def test_trainer_commands_run_their_ranks_as_srun_tasks(tmp_path: Path, inputs: tuple[str, ...]) -> None:
    train = _dry_run(RECIPES / "tiny_cpu.yaml", tmp_path, "--nodes", "2", inputs=inputs)
    # `sao train` itself (no driver of its own): launcher.kind=slurm in the resolved config makes its
    # ranks srun tasks (platform/launch.py)
    assert "-m megatron_sao.cli train " in train and "#SBATCH --ntasks-per-node=2\n" in train
    config = (tmp_path / "tiny_cpu" / "launch" / "dry-run" / "config.yaml").read_text()
    assert "kind: slurm" in config
    pretrain = _dry_run(RECIPES / "tiny_cpu.yaml", tmp_path / "b", "--command", "config show", inputs=inputs)
    assert "-m megatron_sao.cli config show " in pretrain
    convert = _dry_run(RECIPES / "tiny_cpu.yaml", tmp_path / "c", "--nodes", "2", "--command",
                       "convert hf-to-mcore --hf /ckpt/hf --out /ckpt/mcore --ep 4", inputs=inputs)
    assert ("DRIVER=(srun --overlap --nodes=2 --ntasks=4 --ntasks-per-node=2 --kill-on-bad-exit=1 " in convert
            and "-m megatron_sao.cli convert hf-to-mcore --hf /ckpt/hf --out /ckpt/mcore --ep 4)" in convert)


def test_engines_on_another_partition_make_a_heterogeneous_job(tmp_path: Path, inputs: tuple[str, ...]) -> None:
    text = _dry_run(RECIPES / "deepseek_v3_671b_math_sao.yaml", tmp_path, "--partition", "train",
                    "--engine-partition", "infer", inputs=inputs)
    head, _, engines = text.partition("#SBATCH hetjob\n")
    assert "#SBATCH --nodes=32\n" in head and "#SBATCH --partition=train\n" in head  # 256 trainer GPUs
    assert engines.startswith("#SBATCH --nodes=16\n#SBATCH --ntasks-per-node=1\n#SBATCH --partition=infer\n")
    assert "HET=1\n" in text


def test_a_heterogeneous_job_needs_engine_nodes(tmp_path: Path, inputs: tuple[str, ...],
                                                capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "slurm", str(RECIPES / "tiny_cpu.yaml"), f"run.output_dir={tmp_path}", *inputs,
                 "--dry-run", "--engine-partition", "cpu"]) == 2
    assert "0 engine nodes" in capfd.readouterr().err
    assert main(["launch", "slurm", str(RECIPES / "tiny_cpu.yaml"), f"run.output_dir={tmp_path}", *inputs,
                 "--dry-run", "--engine-nodes", "1"]) == 2
    assert not list(tmp_path.glob("*/launch/dry-run")), "a launch that fails its checks leaves no script"


def test_container_mounts_from_the_recipe_are_added(tmp_path: Path, inputs: tuple[str, ...]) -> None:
    image = tmp_path / "sao.sqsh"
    image.write_bytes(b"")
    text = _dry_run(RECIPES / "qwen3_30b_a3b_math_sao.yaml", tmp_path, "--container", str(image), inputs=inputs,
                    overrides=("launcher.container_mounts=[/scratch:/data]",))
    assert ",/scratch:/data" in text
