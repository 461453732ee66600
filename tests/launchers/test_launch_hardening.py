"""`sao launch` and Ray on bad input and hostile state (issue 32, items 3, 4, 5 and 8's temp dir):

- `sao launch slurm` checks before it writes anything: the layout (the very line `sao plan`
  prints), `--command`, `--port-range`, the data and model paths, the run directory; an error line
  names `sao launch`, not the driver's command; it comes within seconds;
- a `--dry-run`, or another submission, never touches the config a pending job will read (a real
  Slurm on this machine, `local_slurm`);
- Ray starts and joins the same way whatever `~/.ray/auth_token` holds (a token file in a
  temporary HOME), a join that fails says authentication or unreachable, and `sao launch local`
  removes its Ray temp directory."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_sao.cli import main
from megatron_sao.rollout.trajectory_io import write_parquet
from tests.training.trajectories import random_trajectories

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")
SCALE = str(REPO / "recipes" / "qwen3_30b_a3b_math_sao.yaml")
BOUND_S = 10.0
"""The launch's checks in process: well under what a queued job costs before it fails."""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("launch_inputs")
    write_parquet(root / "recorded.parquet", random_trajectories(4, seed=3))
    (root / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    return [f"data.trajectories_path={root / 'recorded.parquet'}", f"data.train_path={root / 'prompts.jsonl'}",
            "model.load_weights=false"]


@pytest.fixture(autouse=True)
def _logs_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands' default log files (`sao-<command>-*.log` in the temp directory) go to tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Every `sao` process imports torch and Megatron (5-10 s on the 2-core VM) before it checks a
    layout; the bounds below time the checks, not that."""
    import megatron_sao.models.build  # noqa: F401


def _launch(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], float]:
    start = time.monotonic()
    code = main(["launch", *argv])
    elapsed = time.monotonic() - start
    lines = capfd.readouterr().err.strip().splitlines()
    return code, [line for line in lines if not re.match(r"[WI]\d{4} [\d:.]+ +\d+ torch/", line)], elapsed


# ---- 4: checked before anything is written ---------------------------------------------------------


@pytest.mark.parametrize("nodes", ["1", "3", "5"])
def test_item4_a_layout_sao_plan_refuses_is_refused_with_the_same_line(tmp_path, inputs, capfd, nodes):
    code, err, elapsed = _launch(capfd, "slurm", SCALE, f"run.output_dir={tmp_path}", *inputs, "--nodes", nodes,
                                 "--dry-run")
    assert code == 2 and len(err) == 1 and elapsed < BOUND_S
    assert main(["plan", SCALE, *inputs, f"launcher.nnodes={nodes}"]) == 2
    plan_line = capfd.readouterr().err.strip().splitlines()[-1]
    assert err[0] == plan_line.replace("sao plan:", "sao launch:", 1)
    assert "32 trainer GPUs" in err[0] and not (tmp_path / "qwen3_30b_a3b_math_sao").exists()  # nothing written


@pytest.mark.parametrize("flags, overrides, message", [
    (["--command", "trian"], [], r"--command 'trian': not a sub-command the job can run; one of 'train', 'sft', "),
    (["--command", "convert hf-to-mcore --hf /x"], [], r"--command 'convert hf-to-mcore --hf /x': the following "
                                                       r"arguments are required: --out"),
    (["--port-range", "29999-20000"], [], r"launcher\.port_range \(--port-range\): port range must look like"),
    (["--port-range", "30000-30007"], [], r"port range 30000-30007 must lie in 1024-65535 and hold at least 16 ports"),
    ([], ["launcher.time_limit=1h"], r"launcher\.time_limit \(--time\): time limit '1h' is not a Slurm time"),
    ([], ["data.trajectories_path=/nonexistent/t.parquet"],
     r"data\.trajectories_path='/nonexistent/t\.parquet': no such file"),
    (["--command", "value-pretrain train"], ["value_pretrain.corpus_dir=/nonexistent/corpus"],
     r"value_pretrain\.corpus_dir: /nonexistent/corpus holds no corpus \(manifest\.json\)"),
    ([], ["actor.load=/nonexistent/ckpt"], r"actor\.load=/nonexistent/ckpt: no such directory"),
    ([], ["model.build_tiny=false", f"model.hf_path={REPO / 'recipes/models/qwen3_30b_a3b_thinking_2507'}",
          "model.load_weights=true", "model.num_layers=null", "model.hidden_size=null",
          "model.num_attention_heads=null", "model.num_query_groups=null", "model.num_experts=null",
          "model.moe_router_topk=null",
          "model.moe_ffn_hidden_size=null", "parallelism.expert=1"],
     r"model\.hf_path=.*qwen3_30b_a3b_thinking_2507: no model weights \(no model\.safetensors\.index\.json and no "
     r"\*\.safetensors\)"),
])
def test_item4_command_ports_time_and_paths_are_checked_before_the_script_is_written(
        tmp_path, inputs, capfd, flags, overrides, message):
    code, err, elapsed = _launch(capfd, "slurm", TINY, f"run.output_dir={tmp_path}", *inputs, *overrides,
                                 "--dry-run", *flags)
    assert code == 2 and len(err) == 1 and elapsed < BOUND_S
    assert re.match(r"sao launch: (config )?error: ", err[0]) and re.search(message, err[0]), err[0]
    assert not list(tmp_path.glob("*/launch/*"))


def test_item5_an_unwritable_run_directory_is_named_by_sao_launch(tmp_path, inputs, capfd):
    """The line names `sao launch` (it named the `--command`, e.g. `sao sft`, before)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err, _ = _launch(capfd, "slurm", TINY, f"run.output_dir={blocker}", *inputs, "--command", "sft",
                           "--dry-run")
    assert code == 2 and err == [f"sao launch: error: run directory (run.output_dir/run.name) {blocker / 'tiny_cpu'}: "
                                 f"a file is in the way, not a directory ({blocker} is one)"]
    code, err, _ = _launch(capfd, "local", TINY, f"run.output_dir={blocker}", *inputs)
    assert code == 2 and err[0].startswith("sao launch: error: run directory")


def test_item4_a_dry_run_writes_where_no_job_reads(tmp_path, inputs, capfd):
    assert main(["launch", "slurm", TINY, f"run.output_dir={tmp_path}", *inputs, "--dry-run"]) == 0
    script = tmp_path / "tiny_cpu" / "launch" / "dry-run" / "sao_job.sbatch"
    assert f"sbatch script: {script}" in capfd.readouterr().out
    assert f"{script.parent / 'config.yaml'} checkpoint.resume=auto" in script.read_text()
    assert sorted(p.name for p in (tmp_path / "tiny_cpu" / "launch").iterdir()) == ["dry-run"]


# ---- 4: a pending job's config on a real Slurm ------------------------------------------------------------


def _config_of(script: Path) -> Path:
    return Path(re.search(r"(\S+/config\.yaml) checkpoint\.resume=auto", script.read_text())[1])


@pytest.mark.timeout(300)
def test_item4_a_pending_jobs_config_stays_byte_identical(local_slurm, tmp_path, inputs, capsys):
    """Submit held (pending), then dry-run and submit again with other values: the pending job's
    script still names its own config, byte for byte what it was at submission."""
    def launch(total_steps: int, *flags: str) -> int:
        return main(["launch", "slurm", TINY, f"run.output_dir={tmp_path}", *inputs, "launcher.nproc_per_node=1",
                     "launcher.extra_sbatch=[--hold]", f"run.total_steps={total_steps}", "--nodes", "2",
                     "--allow-loopback", *flags])

    jobs = []
    try:
        assert launch(5) == 0
        out = capsys.readouterr().out
        jobs.append(re.search(r"submitted job (\d+)", out)[1])
        first = Path(re.search(r"sbatch script: (\S+)", out)[1])
        config = _config_of(first)
        assert config.parent == first.parent and config.parent.name.startswith("submit-")
        before = config.read_bytes()
        assert re.search(r"JobState=PENDING", subprocess.run(["scontrol", "show", "job", jobs[0]],
                                                              capture_output=True, text=True).stdout)
        assert launch(7, "--dry-run") == 0
        assert launch(9) == 0
        out = capsys.readouterr().out
        jobs += re.findall(r"submitted job (\d+)", out)
        second = Path(re.findall(r"sbatch script: (\S+)", out)[-1])
        assert config.read_bytes() == before and _config_of(first) == config
        assert _config_of(second) != config and "total_steps: 9" in _config_of(second).read_text()
        assert "total_steps: 5" in before.decode()
        assert (first.parent / "job_id").read_text().strip() == jobs[0]
    finally:
        for job in jobs:
            subprocess.run(["scancel", job], check=False)


# ---- 3: Ray and ~/.ray/auth_token ----------------------------------------------------------------------


@pytest.fixture
def token_home(tmp_path: Path) -> dict[str, str]:
    """The environment of a user whose ~/.ray/auth_token exists (Ray's first local `ray.init()` writes
    it), without any RAY_AUTH_* of its own."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(home)
    return env


@pytest.mark.slow  # ~30-60 s: a one-node Ray cluster, the barrier, `sao config show` as the driver
@pytest.mark.timeout(400)
def test_item3_item8_launch_local_forms_ray_with_a_token_file_present_and_removes_its_temp_dir(tmp_path, token_home):
    proc = subprocess.run([sys.executable, "-m", "megatron_sao.cli", "launch", "local", TINY,
                           f"run.output_dir={tmp_path / 'runs'}", "--command", "config show"],
                          capture_output=True, text=True, env=token_home, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # (it used to wait out the 120 s join barrier, "Ray did not start", exit 3)
    assert "sao: Ray cluster complete: 1 nodes" in proc.stdout and "driver exited with 0" in proc.stdout
    temp = re.search(r"(/tmp/ray_sao_local_\d+)/session_", proc.stdout)
    assert temp and not Path(temp[1]).exists()


def _start_head(port: int, temp: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_sao.platform.ray_cluster", "start", "--ip", "127.0.0.1",
                             "--first-port", str(port), "--port-count", "16", "--num-cpus", "1", "--temp-dir",
                             str(temp)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _wait(address: str, env: dict[str, str], timeout_s: float) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_sao.platform.ray_cluster", "wait", "--address", address,
                           "--nodes", "1", "--timeout", str(timeout_s)], capture_output=True, text=True, env=env,
                          timeout=timeout_s + 90)
    return proc, time.monotonic() - start


# Slow: the local instance with a token file present stays in the default suite.
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_item3_a_join_failure_says_authentication_or_unreachable(tmp_path, token_home):
    from megatron_sao.platform.distributed import free_port

    port = free_port()
    proc, elapsed = _wait(f"127.0.0.1:{port}", {**token_home, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "b" * 64}, 5)
    assert proc.returncode == 3 and elapsed < 60  # ray.init used to retry an empty port for minutes
    assert f"unreachable: nothing answers at 127.0.0.1:{port}" in proc.stderr.strip().splitlines()[-1]
    temp = Path(tempfile.mkdtemp(prefix="ray_sao_t_", dir="/tmp"))  # Ray's socket paths must stay short
    head = _start_head(port, temp, {**token_home, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "a" * 64})
    try:
        ok, _ = _wait(f"127.0.0.1:{port}", {**token_home, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "a" * 64}, 120)
        assert ok.returncode == 0, ok.stderr[-2000:]
        proc, elapsed = _wait(f"127.0.0.1:{port}", {**token_home, "RAY_AUTH_MODE": "token",
                                                    "RAY_AUTH_TOKEN": "b" * 64}, 120)
        assert proc.returncode == 3 and elapsed < 90  # at once, not after the 120 s timeout
        assert proc.stderr.strip().splitlines()[-1].startswith(
            f"sao: authentication failed: the Ray cluster at 127.0.0.1:{port} refused this client's token")
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=90)
        shutil.rmtree(temp, ignore_errors=True)


def test_item3_ray_start_refuses_to_guess_the_authentication_mode(tmp_path, token_home):
    proc = subprocess.run([sys.executable, "-m", "megatron_sao.platform.ray_cluster", "start", "--ip", "127.0.0.1",
                           "--first-port", "23000", "--port-count", "16", "--num-cpus", "1", "--temp-dir",
                           str(tmp_path / "ray")], capture_output=True, text=True, env=token_home, timeout=120)
    assert proc.returncode == 2 and "RAY_AUTH_MODE is not set" in proc.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("token_file", [True, False])
def test_item3_a_local_instance_starts_the_same_way_whatever_home_holds(tmp_path, token_home, token_file):
    """`connect_ray("")` (the embedded default's local Ray): works with or without ~/.ray/auth_token,
    never writes one, and its workers run."""
    token = Path(token_home["HOME"]) / ".ray" / "auth_token"
    if not token_file:
        token.unlink()
    code = ("from megatron_sao.platform.ray_ranks import connect_ray\nimport ray\nassert connect_ray('', 1)\n"
            "print('answer', ray.get(ray.remote(lambda: 41 + 1).remote()))\nray.shutdown()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=token_home, timeout=240)
    assert proc.returncode == 0 and "answer 42" in proc.stdout, proc.stderr[-3000:]
    assert token.exists() == token_file
