"""Tiny repository tasks for the worked SWE example, generated deterministically (no downloads).

A task is a small Python package with one bug in one function, a decoy function that is right,
and `unittest` tests covering both; the buggy function fails its tests. The prompt quotes a call
that returns the wrong value (the "issue"). What `(seed, index)` picks: the buggy function (5
kinds), the decoy, the package and module names, and the examples in the issue and the tests.

    python -m examples.swe_agent.swe_tasks --out checkpoints/swe/train.jsonl --num 256

writes prompt rows (docs/datasets-and-environments.md): `id`, `messages` and `metadata` holding
the repository (`files`: path -> text) and the paths of its tests (`test_files`), which the
verifier restores before running them. The fix is not in the row: `make_task(seed, index)`
recomputes it (`fixed_files`) for tests and oracles, so a policy that reads the dataset finds only
what the prompt says.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYSTEM_PROMPT = ("You fix bugs in the Python repository in the current directory with the bash tool. "
                 "`python -m unittest` runs its tests. Answer without a tool call when you are done.")
_PACKAGES = ("mathkit", "listtools", "textkit", "numutil", "seqlib", "calckit")
_MODULES = ("core", "ops", "helpers", "utils")
_WORDS = ("red", "fox", "sky", "tree", "moon", "leaf", "code")


@dataclass(frozen=True, slots=True)
class _Function:
    name: str
    params: str
    doc: str
    correct: str
    """The return expression of the right implementation."""
    buggy: str
    draw: Callable[[random.Random], tuple[Any, ...]]
    """Example arguments."""


def _words(rng: random.Random) -> tuple[Any, ...]:
    words = rng.sample(_WORDS, rng.randint(2, 4))
    text = words[0]
    for word in words[1:]:
        text += rng.choice((" ", "  ", "\n")) + word
    return (text,)


def _last_items(rng: random.Random) -> tuple[Any, ...]:
    items = rng.sample(range(10, 99), rng.randint(3, 6))
    return items, rng.randint(1, len(items) - 1)


def _clamp(rng: random.Random) -> tuple[Any, ...]:
    low = rng.randint(0, 5)
    high = low + rng.randint(3, 9)
    return rng.randint(low - 4, high + 4), low, high


FUNCTIONS: tuple[_Function, ...] = (
    _Function("scale", "values, factor", "Every value multiplied by factor.",
              "[v * factor for v in values]", "[v + factor for v in values]",
              lambda rng: ([rng.randint(1, 9) for _ in range(rng.randint(2, 4))], rng.randint(3, 6))),
    _Function("clamp", "x, low, high", "x limited to the range [low, high].",
              "max(low, min(x, high))", "min(low, max(x, high))", _clamp),
    _Function("last_items", "items, n", "The last n items, in order.",
              "items[len(items) - n:]", "items[len(items) - n + 1:]", _last_items),
    _Function("count_words", "text", "Number of words separated by any whitespace.",
              "len(text.split())", 'len(text.split(" "))', _words),
    _Function("mean", "values", "Arithmetic mean of the values.",
              "sum(values) / len(values)", "sum(values) // len(values)",
              lambda rng: ([rng.randint(1, 20) for _ in range(rng.randint(2, 5))],)),
)


@dataclass(frozen=True, slots=True)
class SweTask:
    prompt_id: str
    messages: list[dict[str, str]]
    files: dict[str, str]
    """The repository as the agent gets it: relative path -> text."""
    fixed_files: dict[str, str]
    """The files a correct fix changes, fixed."""
    test_files: tuple[str, ...]
    function: str
    """The buggy function's name."""

    def to_row(self) -> dict[str, Any]:
        return {"id": self.prompt_id, "messages": self.messages,
                "metadata": {"files": self.files, "test_files": list(self.test_files), "function": self.function}}


def _compile(fn: _Function, expr: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(f"def {fn.name}({fn.params}):\n    return {expr}\n", namespace)  # our own templates, never model text
    return namespace[fn.name]


def _source(functions: list[tuple[_Function, str]]) -> str:
    return "\n\n".join(f'def {fn.name}({fn.params}):\n    """{fn.doc}"""\n    return {expr}\n'
                       for fn, expr in functions)


def _call(fn: _Function, args: tuple[Any, ...]) -> str:
    return f"{fn.name}({', '.join(repr(a) for a in args)})"


def _tests(fn: _Function, rng: random.Random, first: tuple[Any, ...], num: int = 3) -> list[str]:
    right = _compile(fn, fn.correct)
    cases = [first] + [fn.draw(rng) for _ in range(num - 1)]
    return [f"        self.assertEqual({_call(fn, args)}, {right(*args)!r})" for args in cases]


def make_task(seed: int, index: int) -> SweTask:
    """Task `index` of the stream `seed` (the same pair always gives the same task)."""
    rng = random.Random(f"swe-{seed}-{index}")
    bug, decoy = rng.sample(FUNCTIONS, 2)
    package, module = rng.choice(_PACKAGES), rng.choice(_MODULES)
    right, wrong = _compile(bug, bug.correct), _compile(bug, bug.buggy)
    for _ in range(1000):  # the issue quotes a call where the bug shows
        example = bug.draw(rng)
        if right(*example) != wrong(*example):
            break
    else:
        raise AssertionError(f"no example exposes the bug in {bug.name}")
    order = sorted([(bug, bug.buggy), (decoy, decoy.correct)], key=lambda item: item[0].name)
    fixed = sorted([(bug, bug.correct), (decoy, decoy.correct)], key=lambda item: item[0].name)
    code_path, test_path = f"{package}/{module}.py", f"tests/test_{module}.py"
    names = ", ".join(fn.name for fn, _ in order)
    test_source = (f"import unittest\n\nfrom {package}.{module} import {names}\n\n\n"
                   f"class Test{module.capitalize()}(unittest.TestCase):\n")
    for fn, first in ((bug, example), (decoy, decoy.draw(rng))):
        test_source += f"    def test_{fn.name}(self):\n" + "\n".join(_tests(fn, rng, first)) + "\n\n"
    files = {
        "README.md": f"# {package}\n\nSmall helpers. Run the tests with `python -m unittest`.\n",
        f"{package}/__init__.py": f"from {package}.{module} import {names}\n",
        code_path: _source(order),
        "tests/__init__.py": "",
        test_path: test_source.rstrip() + "\n",
    }
    issue = (f"`{package}.{_call(bug, example)}` returns {wrong(*example)!r}, but it should return "
             f"{right(*example)!r}. Please fix it.")
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": issue}]
    return SweTask(prompt_id=f"swe-{seed}-{index}", messages=messages, files=files,
                   fixed_files={code_path: _source(fixed)}, test_files=("tests/__init__.py", test_path),
                   function=bug.name)


def write_swe_dataset(path: str | Path, num: int, seed: int = 0) -> Path:
    """`num` tasks of stream `seed` as a prompt JSONL at `path`."""
    if num < 1:
        raise ValueError(f"write_swe_dataset: num must be >= 1, got {num}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for index in range(num):
            f.write(json.dumps(make_task(seed, index).to_row()) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Write tiny repository tasks (prompt JSONL).")
    parser.add_argument("--out", required=True, help="output .jsonl")
    parser.add_argument("--num", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_swe_dataset(args.out, args.num, args.seed))


if __name__ == "__main__":
    main()
