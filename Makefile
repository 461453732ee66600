# The two commands of the README's quick start, plus a few more. Each sets up ./.venv first.
SHELL := /bin/bash
VENV := .venv
PYTEST := $(VENV)/bin/python -m pytest
export HF_HUB_OFFLINE := 1
export WANDB_MODE ?= offline
export RAY_AUTH_MODE := disabled

.PHONY: setup demo demo-recorded demo-engine demo-swe online test test-slow lint clean

setup:
	@bash tools/setup_env.sh

# Main job on the embedded default (recipes/tiny_cpu.yaml): the whole recipe on the tiny MoE, CPU:
# convert -> SFT on demonstrations -> value pretraining -> SAO through CPU rollout engines ->
# held-out evaluation (last line: `held-out success: sft=... sao=... (N prompts)`).
demo: setup
	$(VENV)/bin/sao demo recipes/tiny_cpu.yaml

# The trainer alone on recorded trajectories of a scripted task (written first; kept when up to date).
DEMO_TRAJECTORIES := checkpoints/tiny-qwen3-moe/scripted.parquet
demo-recorded: setup
	$(VENV)/bin/python tools/make_scripted_trajectories.py --recipe recipes/tiny_cpu.yaml --out $(DEMO_TRAJECTORIES) --num 512 --seed 0
	$(VENV)/bin/sao train recipes/tiny_cpu.yaml

# The same tiny model trained through the asynchronous pipeline: a CPU rollout engine on the calc task.
demo-engine: setup
	$(VENV)/bin/python tools/make_calc_prompts.py --out checkpoints/calc/train.jsonl --num 2048 --seed 0
	$(VENV)/bin/sao train recipes/tiny_cpu_engine.yaml

# The agent gateway's worked example: a small SWE agent (openai client, bash tool in the sandbox)
# trained a few steps through the gateway on the tiny model (docs/gateway.md#worked-example). Its
# programs live in examples/, outside the library: the repository root goes on the import path.
demo-swe: export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
demo-swe: setup
	$(VENV)/bin/python -m examples.swe_agent.swe_tasks --out checkpoints/swe/train.jsonl --num 256
	$(VENV)/bin/sao train recipes/tiny_cpu_swe.yaml

# Online mode: a reward that shifts in three phases; SAO's critic vs a running-mean baseline,
# compared side by side (docs/pipeline.md#online-mode). Reuses the demo's SFT and value stages.
online: setup
	$(VENV)/bin/sao online recipes/tiny_cpu_online.yaml

# Default test suite (CPU; GPU tests skip; slow tests excluded). Exits non-zero on any failure.
test: setup
	$(PYTEST) -q -m "not slow" --timeout=900 --durations=30 tests

# Longer tests (run separately).
test-slow: setup
	$(PYTEST) -q -m slow --timeout=1800 tests

# Lint: ruff, the import contracts of the package layers ([tool.importlinter] in pyproject.toml) and
# mypy on the seams ([tool.mypy]). CI runs it (.ci/run).
lint: setup
	$(VENV)/bin/ruff check megatron_sao tests tools examples
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

clean:
	rm -rf runs .pytest_cache
