"""The worked example (examples/swe_agent/): tiny repository tasks, the sandboxed
bash tool, the unit-test verifier, the `openai`-client scaffold through the gateway (an oracle
engine that fixes the bug; the random tiny model on a CPU engine that does not), and `sao train`
on recipes/tiny_cpu_swe.yaml."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.swe_agent.sandbox_repo import run_command
from examples.swe_agent.swe_scaffold import write_repo
from examples.swe_agent.swe_tasks import make_task, write_swe_dataset
from examples.swe_agent.swe_verify import verify
from megatron_sao.rollout.agent_loop import AgentLoopConfig
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.environment import PromptSample
from megatron_sao.rollout.envs import make_env_factory
from megatron_sao.rollout.gateway import ScaffoldRunner
from megatron_sao.rollout.trajectory import TrajectoryStatus
from tests.rollout.engine_helpers import IM_END, Answer, ScriptedEngine, cpu_engine, tiny_checkpoint, tools_tokenizer
from tests.rollout.gateway.helpers import RecordingClient, action_spans

EXAMPLES = "examples.swe_agent"
REPO = Path(__file__).parents[2]
RECIPE = REPO / "recipes" / "tiny_cpu_swe.yaml"
# The example lives outside the library: the programs the environment starts in their work
# directories find it through the repository root on the import path, as `make demo-swe` sets it.
PYTHONPATH = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


def _sample(task) -> PromptSample:
    row = task.to_row()
    return PromptSample(prompt_id=row["id"], messages=row["messages"], metadata=row["metadata"])


def _factory(tmp_path: Path, max_steps: int, **kwargs):
    return make_env_factory(
        "openai_scaffold", command=["{python}", "-m", f"{EXAMPLES}.swe_scaffold", "--max-steps", str(max_steps),
                                    "--command-timeout", "5", "--max-output-chars", "300"],
        verifier_command=["{python}", "-m", f"{EXAMPLES}.swe_verify"], timeout_s=180, keep_workdir=True,
        workdir_root=str(tmp_path), extra_env={"PYTHONPATH": PYTHONPATH}, **kwargs)


def _run(factory, client, tokenizer, samples, **config):
    async def go():
        runner = ScaffoldRunner(AgentLoopConfig(**config), tokenizer, EnginePool([client]), factory)
        try:
            return await runner.run(samples)
        finally:
            await runner.close()

    return asyncio.run(go())


def test_tasks_are_deterministic_and_the_rows_hold_no_fix(tmp_path: Path) -> None:
    assert make_task(3, 5) == make_task(3, 5)
    assert len({make_task(0, i).messages[1]["content"] for i in range(16)}) == 16
    rows = [json.loads(line) for line in write_swe_dataset(tmp_path / "swe.jsonl", 4, seed=0).read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"swe-0-{i}" for i in range(4)]
    for i, row in enumerate(rows):
        task = make_task(0, i)
        (path, fixed), = task.fixed_files.items()
        assert row["metadata"]["files"][path] != fixed and fixed not in json.dumps(row)
        assert set(task.test_files) <= set(row["metadata"]["files"])


def test_verifier_gives_one_only_for_a_correct_fix(tmp_path: Path) -> None:
    task = make_task(0, 1)
    row = task.to_row()
    repo = tmp_path / "repo"
    write_repo(task.files, repo)
    assert verify(row, repo)[0] == 0.0  # the bug as shipped fails its tests
    (test_path,) = [p for p in task.test_files if not p.endswith("__init__.py")]
    # The same tests with every assertion gone would pass: the verifier runs the task's own file.
    forged = "\n".join("        pass" if line.strip().startswith("self.assert") else line
                       for line in task.files[test_path].splitlines())
    (repo / test_path).write_text(forged + "\n")
    assert verify(row, repo)[0] == 0.0
    write_repo(task.fixed_files, repo)
    (tmp_path / "task.json").write_text(json.dumps(row))
    run = subprocess.run([sys.executable, "-m", f"{EXAMPLES}.swe_verify"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "SAO_WORKDIR": str(tmp_path), "PYTHONPATH": PYTHONPATH})
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1] == "1.0", run.stdout + run.stderr
    assert f"test_{task.function} " in run.stdout and "OK" in run.stdout


def test_sandboxed_command_sees_a_copy_and_its_changes_come_back(tmp_path: Path) -> None:
    repo, probe = tmp_path / "repo", tmp_path / "outside.txt"
    write_repo({"a.txt": "before\n"}, repo)
    result = run_command(repo, f"cat a.txt; echo after > a.txt; mkdir -p d; echo new > d/b.txt; id -u; "
                               f"echo x > {probe}", timeout_s=5)
    lines = result.output.splitlines()
    assert result.exit_code == 1 and result.files_kept and lines[0] == "before"
    assert int(lines[1]) >= 2_000_000_000  # the sandbox's private uid, not ours
    assert not probe.exists() and "outside.txt" in result.output  # the host path is not there
    assert (repo / "a.txt").read_text() == "after\n" and (repo / "d" / "b.txt").read_text() == "new\n"


def _call(command: str) -> list[int]:
    block = json.dumps({"name": "bash", "arguments": {"command": command}})
    return [*tools_tokenizer().encode(f"<tool_call>\n{block}\n</tool_call>", add_special_tokens=False), IM_END]


def test_oracle_scaffold_episode_fixes_the_bug_and_earns_one(tmp_path: Path) -> None:
    task = make_task(0, 2)
    (path, fixed), = task.fixed_files.items()
    script = [_call("python -m unittest 2>&1 | tail -1"),
              _call(f"cat > {path} <<'EOF'\n{fixed}EOF\npython -m unittest"),
              [*tools_tokenizer().encode("Fixed.", add_special_tokens=False), IM_END]]
    engine = ScriptedEngine([Answer(tokens, "stop", None) for tokens in script])
    (traj,) = _run(_factory(tmp_path, max_steps=5), engine, tools_tokenizer(), [_sample(task)],
                   max_turns=5, max_new_tokens_per_turn=512, max_total_tokens=4096)
    assert traj.status == TrajectoryStatus.COMPLETED, traj.status_reason
    assert traj.terminal_reward == 1.0 and action_spans(traj) == script
    text = tools_tokenizer().decode(traj.token_ids, skip_special_tokens=False)
    assert "FAILED (failures=1)\n\n[exit status 0]" in text  # the tests ran in the sandbox, on the bug
    assert "OK\n\n[exit status 0]" in text  # ... and after the fix
    workdir = Path(traj.metadata["scaffold"]["workdir"])
    assert (workdir / "repo" / path).read_text() == fixed  # the sandbox's change came back


def test_tiny_model_episode_on_cpu_engine_is_recorded_with_sandboxed_calls(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    task = make_task(0, 0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint())  # the recipe's: no tools in its template
    factory = _factory(tmp_path, max_steps=2,
                       tool_call_format=f"{EXAMPLES}.tiny_tool_format:EveryTurnIsBash")
    with cpu_engine() as engine:
        client = RecordingClient(engine.url)
        (traj,) = _run(factory, client, tokenizer, [_sample(task)], max_turns=2, max_new_tokens_per_turn=16,
                       max_total_tokens=1024)
    assert traj.status == TrajectoryStatus.COMPLETED, traj.status_reason
    assert traj.terminal_reward == 0.0  # random bytes fix nothing; the verifier ran and said so
    traj.validate()
    outputs = [out for _, out in client.calls]
    assert len(traj.turns) == 2 and action_spans(traj) == [out.output_ids for out in outputs]
    assert [inp for inp, _ in client.calls] == [traj.token_ids[:t.action_start] for t in traj.turns]
    first = traj.turns[0]
    assert traj.rollout_logprobs[first.action_start:first.action_end] == outputs[0].output_logprobs
    observation = tokenizer.decode(traj.token_ids[first.action_end:traj.turns[1].action_start])
    assert "[exit status" in observation or "[timed out" in observation  # written inside the sandbox
    log = (Path(traj.metadata["scaffold"]["workdir"]) / "scaffold.log").read_text()
    assert log.count("tool_calls=1") == 2, log


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sao_train_runs_the_swe_example(tmp_path: Path, tiny_hf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_sao.config import load_config
    from megatron_sao.jobs.train import run_train

    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)  # the scaffolds the run starts inherit it
    prompts = write_swe_dataset(tmp_path / "swe.jsonl", 32, seed=0)
    config = load_config(str(RECIPE), [f"run.output_dir={tmp_path}", f"model.hf_path={tiny_hf_dir}",
                                       f"data.train_path={prompts}", "launcher.nproc_per_node=1",
                                       "parallelism.expert=1", "logging.wandb_mode=disabled"])
    code, result, run_dir = run_train(config)
    assert code == 0 and result["step"] == config.run.total_steps
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["rollout/started"] == (r["rollout/completed"] + r["rollout/aborted"] + r["rollout/failed"]
                                        + r["rollout/in_flight"])
        assert r["train/trajectories"] == config.data.batch_size
    assert rows[-1]["rollout/failed"] == 0  # every scaffold ran and was scored
    actor_steps = config.run.total_steps - config.critic.warmup_steps
    assert rows[-1]["train/actor_version"] == actor_steps and rows[-1]["rollout/weight_version"] == actor_steps
