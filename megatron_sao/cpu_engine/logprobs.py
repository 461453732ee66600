"""What a request asked for beyond the sampled tokens' log-probs, and SGLang's `meta_info` shapes.

With `return_logprob`, SGLang answers `input_token_logprobs` (prompt tokens from
`logprob_start_len`), `output_token_logprobs`, and, when asked, `input_top_logprobs` /
`output_top_logprobs` (`top_logprobs_num`) and `input_token_ids_logprobs` /
`output_token_ids_logprobs` (`token_ids_logprob`). Entries are `[logprob, token_id, text]` (text
only with `return_text_in_logprobs`); a position's top / token-id list is a list of such entries.

Semantics (sglang 0.5.23's logits processor and sampler):
- prompt entries cover `input_ids[start:]`; the first entry's log-prob is always null, the k-th is
  `log_softmax(logits)` (temperature 1, no penalties) of token `start + k` given the tokens before
  it; `logprob_start_len = -1` (the default) means no prompt entries;
- output top-k / token-id log-probs come from the same distribution as the sampled token's
  log-prob (sampling.py: temperature-scaled, after penalties; temperature 1 with
  `return_original_logprob`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Entry = tuple[float | None, int]


@dataclass(slots=True)
class LogprobState:
    """One request's log-prob options and what was computed for them (request.py holds one when
    `return_logprob` is set)."""

    start: int | None = None
    """First prompt position with an entry (None: no prompt entries)."""
    top_n: int = 0
    token_ids: list[int] | None = None
    input_done: bool = False
    input_token: list[Entry] = field(default_factory=list)
    input_top: list[list[Entry] | None] = field(default_factory=list)
    input_ids: list[list[Entry] | None] = field(default_factory=list)
    output_top: list[list[Entry]] = field(default_factory=list)
    output_ids: list[list[Entry]] = field(default_factory=list)

    @property
    def wants_distribution(self) -> bool:
        """Whether each output step needs the full distribution (top-k or token-id entries)."""
        return self.top_n > 0 or self.token_ids is not None

    def wants_prompt(self, prompt: list[int]) -> bool:
        """Whether prompt entries are still to be computed (at the request's first prefill)."""
        return not self.input_done and self.start is not None and self.start < len(prompt)

    def prompt_positions(self, prompt_len: int) -> int:
        """How many of the prompt's last positions' logits the prefill must keep (1 = the last)."""
        if self.input_done or self.start is None or self.start >= prompt_len:
            return 1
        return prompt_len - self.start

    def record_prompt(self, prompt: list[int], logits: torch.Tensor) -> None:
        """Fill the prompt entries from `logits` [k, V], the logits of the prompt's last k positions
        (k >= prompt_positions). Called once, at the request's first prefill."""
        if not self.wants_prompt(prompt):
            return
        self.input_done = True
        assert self.start is not None
        n = len(prompt) - self.start
        assert logits.shape[0] >= n, (logits.shape, n)
        logprobs = torch.log_softmax(logits[-n:].float(), dim=-1)  # row j predicts prompt[start + j + 1]
        targets = prompt[self.start + 1 :]
        values = logprobs[:-1].gather(1, torch.tensor(targets, dtype=torch.long)[:, None])[:, 0].tolist()
        self.input_token = [(None, prompt[self.start]), *zip(values, targets, strict=True)]
        if self.top_n > 0:
            self.input_top = [None, *(_top(row, self.top_n) for row in logprobs[:-1])]
        if self.token_ids is not None:
            self.input_ids = [None, *(_pick(row, self.token_ids) for row in logprobs[:-1])]

    def record_output(self, logprobs: torch.Tensor) -> None:
        """Record the top-k / token-id entries of one output step's distribution [V]."""
        if self.top_n > 0:
            self.output_top.append(_top(logprobs, self.top_n))
        if self.token_ids is not None:
            self.output_ids.append(_pick(logprobs, self.token_ids))


def _top(logprobs: torch.Tensor, k: int) -> list[Entry]:
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]))
    return list(zip(values.tolist(), ids.tolist(), strict=True))


def _pick(logprobs: torch.Tensor, token_ids: list[int]) -> list[Entry]:
    values = logprobs[torch.tensor(token_ids, dtype=torch.long)].tolist()
    return list(zip(values, token_ids, strict=True))


def meta_entries(state: LogprobState, output: list[Entry], num_output: int, texts) -> dict[str, Any]:
    """The `meta_info` log-prob fields: `output` is the sampled tokens' `(logprob, id)` entries and
    `texts(ids)` decodes token ids one by one (or returns Nones). Only the first `num_output`
    output steps are included (a stream reports what is complete)."""
    def rows(entries: list[Entry]) -> list[list[Any]]:
        words = texts([tok for _, tok in entries])
        return [[lp, tok, word] for (lp, tok), word in zip(entries, words, strict=True)]

    def positions(per_position: list[list[Entry] | None]) -> list[Any]:
        return [None if entries is None else rows(entries) for entries in per_position]

    meta: dict[str, Any] = {
        "input_token_logprobs": rows(state.input_token),
        "output_token_logprobs": rows(output[:num_output]),
        "output_token_logprobs_length": num_output,
    }
    if state.top_n > 0:
        meta["input_top_logprobs"] = positions(state.input_top)
        meta["output_top_logprobs"] = positions(state.output_top[:num_output])  # type: ignore[arg-type]
    if state.token_ids is not None:
        meta["input_token_ids_logprobs"] = positions(state.input_ids)
        meta["output_token_ids_logprobs"] = positions(state.output_ids[:num_output])  # type: ignore[arg-type]
    return meta
