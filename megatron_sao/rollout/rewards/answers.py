"""Answer-checking rewards: final-answer extraction, exact match, math equivalence.

Math equivalence uses math-verify (LaTeX / expression parsing, sets, intervals, units), and
falls back to a small sympy checker when math-verify is missing or raises. Model text never
reaches `eval`: the fallback only accepts a whitelisted arithmetic alphabet before sympy
parses it (sympy's parsers call `eval`).
"""

from __future__ import annotations

import re
import threading

from megatron_sao.rollout.rewards.base import RewardInput

BOXED_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    best: tuple[int, str] | None = None
    for command in BOXED_COMMANDS:
        start = text.rfind(command + "{")
        while start != -1:
            content = _balanced(text, start + len(command))
            if content is not None:
                if best is None or start > best[0]:
                    best = (start, content)
                break
            start = text.rfind(command + "{", 0, start)
    return None if best is None else best[1].strip()


def _balanced(text: str, brace: int) -> str | None:
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:i]
    return None


def normalize_answer(text: str) -> str:
    """Whitespace collapsed, surrounding `$` and a trailing period removed."""
    text = " ".join(text.split())
    text = text[:-1].rstrip() if text.endswith(".") else text
    return text.strip("$").strip()


def exact_match(inp: RewardInput, *, case_sensitive: bool = True) -> float:
    """1.0 if the final answer (last boxed, else the whole response) equals the reference."""
    sample, response = inp.sample, inp.response
    if sample.answer is None:
        raise ValueError(f"prompt {sample.prompt_id!r} has no reference answer for exact_match")
    predicted = extract_boxed(response)
    predicted = normalize_answer(response if predicted is None else predicted)
    gold = normalize_answer(sample.answer)
    if not case_sensitive:
        predicted, gold = predicted.casefold(), gold.casefold()
    return 1.0 if predicted == gold else 0.0


def math_equivalence(inp: RewardInput) -> float:
    """1.0 if the last `\\boxed{}` of the response is mathematically equal to the reference.

    No boxed answer scores 0 (the TIR prompt asks for one). A missing reference is an error
    (a data problem, which must surface as a failed reward, not as a silent 0).
    """
    sample, response = inp.sample, inp.response
    if sample.answer is None:
        raise ValueError(f"prompt {sample.prompt_id!r} has no reference answer for math_equivalence")
    predicted = extract_boxed(response)
    if predicted is None:
        return 0.0
    return 1.0 if answers_equivalent(predicted, sample.answer) else 0.0


def answers_equivalent(predicted: str, gold: str, backend: str = "auto") -> bool:
    """Whether two final answers are equal: `auto` tries math-verify, then sympy."""
    if normalize_answer(predicted) == normalize_answer(gold):
        return True
    if backend in ("auto", "math_verify"):
        try:
            return _math_verify_equivalent(predicted, gold)
        except Exception:
            if backend == "math_verify":
                raise
    return sympy_equivalent(predicted, gold)


def _math_verify_equivalent(predicted: str, gold: str) -> bool:
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (5, 5) if main else (None, None)
    gold_parsed = parse(f"${gold}$", parsing_timeout=parse_timeout, raise_on_error=True)
    pred_parsed = parse(f"\\boxed{{{predicted}}}", parsing_timeout=parse_timeout, raise_on_error=True)
    if not gold_parsed or not pred_parsed:
        raise ValueError(f"math-verify could not parse {gold!r} or {predicted!r}")
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout, raise_on_error=True))


_LATEX_REWRITES = [
    (re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}"), r"((\1)/(\2))"),
    (re.compile(r"\\sqrt\{([^{}]*)\}"), r"sqrt(\1)"),
    (re.compile(r"\\(left|right|!|,|;|:)"), ""),
    (re.compile(r"\\(cdot|times)"), "*"),
    (re.compile(r"\\pi"), "pi"),
    (re.compile(r"\^\{([^{}]*)\}"), r"^(\1)"),
]
_SAFE_EXPRESSION = re.compile(r"[0-9a-zA-Z+\-*/^().\s]*")
_ALLOWED_NAMES = {"sqrt", "pi", "E", "exp", "log", "ln", "sin", "cos", "tan", "oo"}
_MAX_FALLBACK_CHARS = 200


_MAX_EXPONENT = 100


def _powers_are_small(expr: object) -> bool:
    """Every numeric exponent (checked innermost first) is at most `_MAX_EXPONENT` in size,
    so evaluating cannot build astronomically large integers (9^9^9 style inputs)."""
    import sympy

    for node in sympy.postorder_traversal(expr):
        if isinstance(node, sympy.Pow) and not node.exp.free_symbols:
            try:
                if abs(complex(sympy.N(node.exp, 15))) > _MAX_EXPONENT:
                    return False
            except (TypeError, ValueError):
                return False
    return True


def _to_sympy(text: str) -> object | None:
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations

    text = normalize_answer(text)
    for _ in range(5):  # nested \frac / \sqrt unwind from the inside out
        for pattern, replacement in _LATEX_REWRITES:
            text = pattern.sub(replacement, text)
    text = text.replace("{", "(").replace("}", ")")
    if len(text) > _MAX_FALLBACK_CHARS or not _SAFE_EXPRESSION.fullmatch(text) or text.count("^") > 3:
        return None
    names = set(re.findall(r"[A-Za-z]+", text))
    if any(len(name) > 1 and name not in _ALLOWED_NAMES for name in names) or re.search(r"\.\s*[A-Za-z]", text):
        return None  # no attribute access, no unknown functions: sympy's parser uses eval
    try:
        expr = parse_expr(text.replace("^", "**"), local_dict={"ln": sympy.log}, evaluate=False,
                          transformations=(*standard_transformations, implicit_multiplication))
    except Exception:
        return None
    return expr if _powers_are_small(expr) else None


def sympy_equivalent(predicted: str, gold: str) -> bool:
    """Fallback checker: symbolic difference simplifies to zero, or numerically equal."""
    import sympy

    a, b = _to_sympy(predicted), _to_sympy(gold)
    if a is None or b is None:
        return False
    try:
        if sympy.simplify(a - b) == 0:
            return True
        fa, fb = complex(sympy.N(a)), complex(sympy.N(b))
    except Exception:
        return False
    return abs(fa - fb) <= 1e-6 * max(1.0, abs(fb))
