"""What convert --auto chose, in words: the dry run's per-group lines and the summary's one line."""

from __future__ import annotations

import textwrap


def _budget(choice) -> str:
    req = choice.request
    if req.target_bits is not None:
        return f"target {req.target_bits:g} bits per weight"
    return f"--max-size {req.max_size_text} ({choice.budget_bits / max(1, choice.weights):.4f} bits per weight left)"


def auto_summary(choice) -> str:
    """One line: the layout, the mix, achieved bits vs the budget, the predicted error."""
    counts: dict[str, int] = {}
    for r in choice.picks:
        counts[r] = counts.get(r, 0) + 1
    mix = ", ".join(f"{r} {n} group{'s' if n != 1 else ''}" for r, n in sorted(counts.items()))
    return (f"auto: {mix} ({choice.layout}); {choice.achieved_bits:.4f} bits per weight over {choice.weights:,} "
            f"weights, {_budget(choice)}; predicted output error {choice.predicted_error:.6g} (the sum of each "
            f"module's error alone quantized: an additive model)")


def auto_lines(choice) -> list[str]:
    """The summary line, then per group: its choice, bits per weight and predicted error, and the
    other candidates' (bits, error) beside it."""
    from quantcli.planning.auto import group_error

    lines = [auto_summary(choice)]
    width = max((len(g.key) for g in choice.groups), default=0)
    for g, r in zip(choice.groups, choice.picks):
        costs = dict(g.costs)
        others = "; ".join(f"{c} {b / g.weights:.2f} bits, {group_error(g, c, choice.scores):.4g}"
                           for c, b in g.costs if c != r)
        lines.append(f"  {g.key:<{width}}  {r:<10} {costs[r] / g.weights:5.2f} bits  error "
                     f"{group_error(g, r, choice.scores):.4g}" + (f"  (else: {others})" if others else ""))
    if choice.curve:
        lines.append("  predicted error at other budgets (bits per weight: error): "
                     + "; ".join(f"{b:.3f}: {e:.4g}" for b, e in choice.curve))
    if choice.left_dense:
        lines.append(f"  left dense (no candidate fits every member of their group): {', '.join(choice.left_dense)}")
    return lines


def print_auto_lines(con, choice) -> None:
    """auto_lines on `con`: at a terminal each wrapped at its width, the rest of a line indented
    under its start (+4); in a pipe one line each, whole, for grep (render.console's soft wrap)."""
    for line in auto_lines(choice):
        if con.is_terminal and len(line) > con.width:
            indent = " " * (len(line) - len(line.lstrip()) + 4)
            line = textwrap.fill(line, width=con.width, subsequent_indent=indent, break_on_hyphens=False)
        con.print(line, markup=False, highlight=False)
