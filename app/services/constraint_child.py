"""The sandbox child: compiles structured-output constraints the way vLLM 0.32's client
process validates them, for one backend, and answers one JSON line per request.

Run as `python -m app.services.constraint_child <backend> <memory_headroom_bytes>` by
`ConstraintSandbox`. It may die (a structured-output library segfaults on some inputs): the
parent reads that as a 400 for the request it was compiling, and starts another child.
Reads `{"kwargs": {...}}` lines on stdin; writes `{"error": null | "..."}` lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Not on Linux: stdin's EOF still ends the loop once the parent is gone.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _guidance() -> Callable[[dict[str, Any]], str | None]:
    """vLLM's `validate_guidance_grammar`: serialize, then `LLMatcher.validate_grammar`
    (the step that segfaults on a deep `$ref` chain or thousands of chained rules)."""
    import llguidance

    def check(kw: dict[str, Any]) -> str | None:
        try:
            if "json" in kw:
                spec = kw["json"] if isinstance(kw["json"], str) else json.dumps(kw["json"])
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    spec, defaults={"whitespace_flexible": True}
                )
            elif "json_object" in kw:
                grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
            elif "regex" in kw:
                grammar = llguidance.grammar_from("regex", kw["regex"])
            elif "choice" in kw:
                grammar = llguidance.grammar_from("choice", kw["choice"])
            else:
                grammar = llguidance.grammar_from("grammar", kw["grammar"])
        except (ValueError, KeyError, TypeError) as exc:
            return f"invalid grammar specification: {exc}"
        err = llguidance.LLMatcher.validate_grammar(grammar, None)
        return f"grammar error: {err}" if err else None

    return check


def _xgrammar() -> Callable[[dict[str, Any]], str | None]:
    """vLLM's `validate_xgrammar_grammar`: parse (not compile) with xgrammar."""
    import xgrammar as xgr

    def check(kw: dict[str, Any]) -> str | None:
        try:
            if "regex" in kw:
                xgr.Grammar.from_regex(kw["regex"])
            elif "choice" in kw:
                alternatives = " | ".join(json.dumps(c) for c in kw["choice"])
                xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
            elif "json" in kw:
                xgr.Grammar.from_json_schema(
                    kw["json"] if isinstance(kw["json"], str) else json.dumps(kw["json"])
                )
            elif "grammar" in kw:
                grammar = kw["grammar"]
                lark = "::=" not in grammar
                xgr.Grammar.from_lark(grammar) if lark else xgr.Grammar.from_ebnf(grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for bad input
            return f"invalid constraint: {exc}"
        return None

    return check


def _auto() -> Callable[[dict[str, Any]], str | None]:
    """vLLM's `auto`: xgrammar, falling back to guidance when xgrammar refuses."""
    xgrammar, guidance = _xgrammar(), _guidance()

    def check(kw: dict[str, Any]) -> str | None:
        return None if xgrammar(kw) is None else guidance(kw)

    return check


def _outlines() -> Callable[[dict[str, Any]], str | None]:
    """vLLM's outlines validation: the JSON schema → regex conversion, then the regex parse."""
    import interegular
    from outlines_core import json_schema  # type: ignore[import-untyped]

    def check(kw: dict[str, Any]) -> str | None:
        try:
            if "json" in kw:
                spec = kw["json"] if isinstance(kw["json"], str) else json.dumps(kw["json"])
                interegular.parse_pattern(json_schema.build_regex_from_schema(spec))
            elif "regex" in kw:
                interegular.parse_pattern(kw["regex"])
            elif "json_object" in kw or "grammar" in kw:
                return "the outlines backend supports neither json_object nor grammars"
        except Exception as exc:  # noqa: BLE001 - several types for bad input
            return f"invalid constraint: {exc}"
        return None

    return check


BACKENDS = {"guidance": _guidance, "xgrammar": _xgrammar, "auto": _auto, "outlines": _outlines}


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


# How much lower than its parent a constraint child's CPU priority is (0..19).
SANDBOX_NICENESS = 10


def main() -> None:
    backend, headroom = sys.argv[1], int(sys.argv[2])
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a segfault writes no core file
    # A compile that burns its time limit gets only the CPU other requests leave.
    os.nice(SANDBOX_NICENESS)
    out = sys.stdout
    try:
        check = BACKENDS[backend]()
    except ImportError as exc:
        out.write(json.dumps({"unavailable": f"{backend}: {exc}"}) + "\n")
        out.flush()
        return
    # Memory is bounded after the library is loaded: the limit is what a compile may add.
    limit = _vm_bytes() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out.write(json.dumps({"ready": backend}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            error = check(json.loads(line)["kwargs"])
        except MemoryError:
            error = "compiling it needed more memory than allowed"
        out.write(json.dumps({"error": error}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
