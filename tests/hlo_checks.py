"""Reading lowered programs (StableHLO text) for what a GPU step must not hold: conditionals and loops whose trip
count is a device value. XLA's GPU runtime copies such a predicate or bound to the host and waits, every step (or
every iteration)."""

from __future__ import annotations

import re


def dynamic_while_loops(stablehlo: str) -> list[str]:
    """The `stablehlo.while` ops whose condition compares against no constant of its own: their trip count is a
    loop-carried (device-side) value, which XLA's GPU runtime reads back to the host every iteration."""
    out = []
    for m in re.finditer(r"stablehlo\.while\(.*?cond \{(.*?)\} do \{", stablehlo, re.S):
        cond = m.group(1)
        compare = re.search(r"stablehlo\.compare\s+\w+,\s*(%[\w#]+),\s*(%[\w#]+)", cond)
        constants = set(re.findall(r"(%[\w#]+) = stablehlo\.constant", cond))
        if compare is None or not constants & set(compare.groups()):
            out.append(m.group(0)[:200])
    return out


def conditionals(stablehlo: str) -> list[str]:
    """The `stablehlo.if` / `stablehlo.case` ops (what `lax.cond` and `lax.switch` lower to)."""
    return [m.group(0) for m in re.finditer(r"stablehlo\.(if|case)\b[^\n]*", stablehlo)]


def host_round_trips(stablehlo: str) -> list[str]:
    """Everything in a lowered step that makes an accelerator's runtime wait on the host."""
    return conditionals(stablehlo) + dynamic_while_loops(stablehlo)
