"""Worked example of an external environment: guess a secret integer, told higher / lower.

Run as a separate process (`python -m megatron_sao.rollout.envs.guess_number`) and driven by
`external.SubprocessEnvironment` over the line protocol documented there; it imports nothing
from the project, as a third-party scaffold would not. The secret is the sample's `answer`;
the model's guess is the last integer in its turn. Reward when found: 1.0 for a first-try guess,
0.1 less per extra guess (at least 0.1); after `MAX_GUESSES` wrong guesses the episode ends at 0,
marked truncated (reason "max_guesses"). The reset reply keeps the dataset's prompt and declares
no tools (both optional in the protocol).
"""

from __future__ import annotations

import json
import re
import sys

MAX_GUESSES = 10


def handle(request: dict, state: dict) -> dict:
    op = request.get("op")
    if op == "reset":
        try:
            state.update(secret=int(request["sample"]["answer"]), guesses=0)
        except (KeyError, TypeError, ValueError):
            return {"error": "the sample's answer must be an integer"}
        return {"ok": True}
    if op == "close":
        return {"ok": True}
    if op != "step" or "secret" not in state:
        return {"error": f"unexpected request {op!r}"}
    numbers = re.findall(r"-?\d+", str(request.get("action", "")))
    if not numbers:
        return {"observation": "Reply with a whole number.", "reward": 0.0, "done": False, "role": "user"}
    state["guesses"] += 1
    guess, secret = int(numbers[-1]), state["secret"]
    info = {"guesses": state["guesses"]}
    if guess == secret:
        return {"observation": "", "reward": max(0.1, 1.0 - 0.1 * (state["guesses"] - 1)), "done": True,
                "info": info}
    if state["guesses"] >= MAX_GUESSES:
        return {"observation": "", "reward": 0.0, "done": True, "truncated": True,
                "info": {**info, "truncation_reason": "max_guesses"}}
    hint = "higher" if secret > guess else "lower"
    return {"observation": f"{guess} is wrong; the number is {hint}.", "reward": 0.0, "done": False,
            "role": "user", "info": info}


def main() -> None:
    state: dict = {}
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError:
            request = None
        reply = handle(request, state) if isinstance(request, dict) else {"error": "request is not a JSON object"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        if isinstance(request, dict) and request.get("op") == "close":
            return


if __name__ == "__main__":
    main()
