"""A worked example of the agent gateway (docs/gateway.md, "Worked example"): a small SWE-style
scaffold written against the `openai` client, the tiny repository tasks it works on, and their
unit-test verifier, trained by `sao train recipes/tiny_cpu_swe.yaml`.

These are programs the `openai_scaffold` environment starts (`python -m ...`), not library code:
nothing in `megatron_sao` imports them.

| module | role |
|---|---|
| `swe_tasks` | deterministic tiny repositories with one bug and the tests that expose it; writes the prompt JSONL |
| `swe_scaffold` | the agent: chat completions with a `bash` tool until it stops; the repository stays in `./repo` |
| `sandbox_repo` | one shell command in the rollout sandbox on a copy of a directory; the changes come back |
| `swe_verify` | the verifier: restores the task's tests, runs them in the sandbox, prints 1.0 or 0.0 |
| `tiny_tool_format` | a tool-call format for the random tiny model: every turn is one `bash` command |
"""
