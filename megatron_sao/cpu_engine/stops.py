"""When a request stops and what text it returns: stop strings, `stop_regex`, stop tokens, length.

Order and windows follow sglang 0.5.23's `Req.update_finish_state`: stop strings, then stop regexes
(both searched in the decoded tail of the output, long enough to hold the longest stop), then stop
tokens / EOS (unless `ignore_eos`), then the length limit. `min_new_tokens` does not delay a stop
string or regex match (SGLang only masks the stop tokens' logits until then, penalties.py).

The returned text is trimmed as SGLang's detokenizer trims it: a matched stop token is dropped
unless `no_stop_trim`; for a matched string the text ends before it (or after it with
`no_stop_trim`). A regex match is looked up as a literal string, as SGLang does, so the text of a
regex match is normally kept.
"""

from __future__ import annotations

import re
from typing import Any, Protocol


class StopState(Protocol):
    """What the stop checks read of a request (`request.EngineRequest` has it): its sampling
    settings (a `sampling_params.SamplingConfig`), its output so far and its limits."""

    sampling: Any
    output_ids: list[int]
    stop_window: int
    max_new_tokens: int

MAX_STOP_REGEX_BYTES = 256  # SGLang's MAX_STOP_REGEX_LEN
UNBOUNDED = 1 << 30
"""Tail window of a regex with unbounded repetition: the whole output is searched (as in SGLang)."""

try:  # the regex parser moved in Python 3.11
    import re._parser as _sre_parse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import sre_parse as _sre_parse  # type: ignore[no-redef]


def compile_stop_regex(pattern: str, name: str) -> re.Pattern[str]:
    """Compile one `stop_regex` pattern, refusing (ValueError naming `name`) what SGLang refuses:
    patterns over 256 UTF-8 bytes and patterns that do not compile."""
    size = len(pattern.encode("utf-8"))
    if size > MAX_STOP_REGEX_BYTES:
        raise ValueError(f"{name} is {size} bytes, over the {MAX_STOP_REGEX_BYTES}-byte limit")
    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise ValueError(f"{name} is not a valid regular expression: {e}") from e


def regex_max_chars(pattern: str) -> int:
    """An upper bound of the characters one match of `pattern` spans (UNBOUNDED for `*`, `+`, ...).
    One character may need one token, so this also bounds the tokens to decode when searching."""
    return min(_max_chars(_sre_parse.parse(pattern)), UNBOUNDED)


def _max_chars(subpattern: Any) -> int:
    total = 0
    for op, value in subpattern:
        if op in (_sre_parse.LITERAL, _sre_parse.NOT_LITERAL, _sre_parse.IN, _sre_parse.ANY):
            total += 1
        elif op == _sre_parse.SUBPATTERN:
            total += _max_chars(value[-1])
        elif op == _sre_parse.BRANCH:
            total += max(_max_chars(branch) for branch in value[1])
        elif op in (_sre_parse.MAX_REPEAT, _sre_parse.MIN_REPEAT, getattr(_sre_parse, "POSSESSIVE_REPEAT", None)):
            _, high, inner = value
            total += UNBOUNDED if high == _sre_parse.MAXREPEAT else high * _max_chars(inner)
        elif op in (_sre_parse.AT, _sre_parse.ASSERT, _sre_parse.ASSERT_NOT):
            continue  # zero-width
        else:  # group references, conditionals, atomic groups: no simple bound
            total += UNBOUNDED
        total = min(total, UNBOUNDED)
    return total


def stop_window(stop_token_lengths: list[int], stop_regex: list[str]) -> int:
    """Output tokens to decode when looking for a stop: the longest stop string's token count (or
    regex's character bound) plus one, as SGLang's `_stop_match_tail_len`."""
    longest = max([0, *stop_token_lengths, *(regex_max_chars(p) for p in stop_regex)])
    return min(longest + 1, UNBOUNDED)


def finish_reason(req: StopState, eos_token_ids: frozenset[int], tokenizer) -> dict[str, Any] | None:
    """SGLang's finish reason for `req` after its latest token, or None while it continues."""
    cfg = req.sampling
    if cfg.stop or cfg.stop_patterns:
        tail = tokenizer.decode(req.output_ids[-req.stop_window :])
        for stop in cfg.stop:
            if stop in tail:
                return {"type": "stop", "matched": stop}
        for pattern in cfg.stop_patterns:
            if pattern.search(tail):
                return {"type": "stop", "matched": pattern.pattern}
    last = req.output_ids[-1]
    if not cfg.ignore_eos and (last in cfg.stop_token_ids or last in eos_token_ids):
        return {"type": "stop", "matched": last}
    if len(req.output_ids) >= req.max_new_tokens:
        return {"type": "length", "length": req.max_new_tokens}
    return None


def output_text(output_ids: list[int], reason: dict[str, Any] | None, sampling, tokenizer) -> str:
    """SGLang's detokenised `text` of a finished request (see the module docstring)."""
    matched = (reason or {}).get("matched") if (reason or {}).get("type") == "stop" else None
    ids = output_ids
    if isinstance(matched, int) and not sampling.no_stop_trim and ids:
        ids = ids[:-1]
    text = decode(ids, sampling, tokenizer)
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos >= 0:
            text = text[: pos + len(matched)] if sampling.no_stop_trim else text[:pos]
    return text


def partial_text(output_ids: list[int], sampling, tokenizer) -> str:
    """The text of an unfinished request as streamed: an incomplete UTF-8 character at the end is
    held back, and so is what may turn out to be a trimmed stop: a last token that is a stop token
    (the request may be finishing on it) and any tail that may be the start of a stop string."""
    stop_ids = {*sampling.stop_token_ids, tokenizer.eos_token_id}
    if output_ids and not sampling.ignore_eos and not sampling.no_stop_trim and output_ids[-1] in stop_ids:
        output_ids = output_ids[:-1]
    text = decode(output_ids, sampling, tokenizer).rstrip("\ufffd")
    cut = len(text)
    for stop in sampling.stop:
        pos = text.find(stop)
        if pos >= 0:
            cut = min(cut, pos)
            continue
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]


def decode(ids: list[int], sampling, tokenizer) -> str:
    return tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens,
                            spaces_between_special_tokens=sampling.spaces_between_special_tokens)
