"""The exact multiple-choice knapsack behind `convert --auto`: one option per group, total cost at
most the budget, least total error.

Dynamic programming over integer costs, kept sparse: after each group the table holds only its
Pareto frontier, the (cost, error) pairs no other partial choice beats in both; every entry above
the budget is dropped. A partial choice off the frontier cannot start an optimal whole one (the
entry that beats it, completed the same way, is as cheap and as good), so the frontier's best entry
within the budget is the optimum. Ties are broken deterministically: the lower error, then the
lower cost, then the choice whose option indices, read group by group, come first."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    cost: int  # integer (bits, as written)
    error: float


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # per group, the index of its option
    cost: int
    error: float


def cheapest(groups: list[list[Option]]) -> int:
    """The smallest total cost any choice has."""
    return sum(min(o.cost for o in g) for g in groups)


def frontier(groups: list[list[Option]], budget: int) -> list[Solution]:
    """Every choice no other beats in both cost and error among those within `budget`, cost
    ascending (error descending); empty when even the cheapest choice costs more. The best choice
    within any smaller budget is among them: its least-error entry of cost at most that budget."""
    if any(not g for g in groups):
        raise ValueError("every group needs at least one option")
    if cheapest(groups) > budget:
        return []
    # the cost still to come at least: what keeps an entry that could never fit out of the table
    rest = [0] * (len(groups) + 1)
    for i in range(len(groups) - 1, -1, -1):
        rest[i] = rest[i + 1] + min(o.cost for o in groups[i])
    table: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    for i, options in enumerate(groups):
        grown = [(c + o.cost, e + o.error, ch + (k,)) for c, e, ch in table for k, o in enumerate(options)
                 if c + o.cost + rest[i + 1] <= budget]
        grown.sort(key=lambda t: (t[0], t[1], t[2]))
        table = []
        for entry in grown:  # cost ascending: keep an entry only if it lowers the error
            if not table or entry[1] < table[-1][1]:
                table.append(entry)
    return [Solution(choice, cost, error) for cost, error, choice in table]


def best_within(solutions: list[Solution], budget: int) -> Solution | None:
    """The least-error entry of `frontier`'s list costing at most `budget` (ties: the lower cost,
    then the choice whose option indices come first), or None when none fits."""
    fitting = [s for s in solutions if s.cost <= budget]
    return min(fitting, key=lambda s: (s.error, s.cost, s.choice)) if fitting else None


def solve(groups: list[list[Option]], budget: int) -> Solution | None:
    """The optimal choice, or None when even the cheapest one costs more than `budget`."""
    return best_within(frontier(groups, budget), budget)
