"""The --auto solver (quantcli/planning/knapsack.py) against brute force on small random instances."""

from __future__ import annotations

import itertools
import random

import pytest

from quantcli.planning.knapsack import Option, best_within, cheapest, frontier, solve


def brute_force(groups, budget):
    best = None
    for choice in itertools.product(*(range(len(g)) for g in groups)):
        cost = sum(groups[i][k].cost for i, k in enumerate(choice))
        error = 0.0
        for i, k in enumerate(choice):
            error += groups[i][k].error
        if cost <= budget and (best is None or (error, cost, choice) < best):
            best = (error, cost, choice)
    return best


@pytest.mark.parametrize("seed", range(200))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    groups = [[Option(rng.randint(1, 40), rng.choice([rng.random(), float(rng.randint(0, 3))]))
               for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 6))]
    budget = rng.randint(cheapest(groups) - 3, sum(max(o.cost for o in g) for g in groups) + 3)
    got, want = solve(groups, budget), brute_force(groups, budget)
    if want is None:
        assert got is None
    else:
        assert (got.error, got.cost, got.choice) == want


@pytest.mark.parametrize("seed", range(50))
def test_one_frontier_gives_every_smaller_budgets_optimum(seed):
    """--auto's budget curve reads each budget's optimum off the frontier of the largest one."""
    rng = random.Random(1000 + seed)
    groups = [[Option(rng.randint(1, 40), rng.choice([rng.random(), float(rng.randint(0, 3))]))
               for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 6))]
    high = sum(max(o.cost for o in g) for g in groups)
    pareto = frontier(groups, high)
    assert [s.cost for s in pareto] == sorted(s.cost for s in pareto)
    for budget in range(cheapest(groups) - 2, high + 1):
        got, want = best_within(pareto, budget), brute_force(groups, budget)
        if want is None:
            assert got is None
        else:
            assert (got.error, got.cost, got.choice) == want


def test_infeasible_and_exact_budget():
    groups = [[Option(4, 1.0), Option(8, 0.0)], [Option(4, 2.0), Option(8, 0.5)]]
    assert solve(groups, 7) is None
    assert solve(groups, 12).choice == (0, 1)  # 1.5 beats 2.0 at the same cost
    assert solve(groups, 16).choice == (1, 1)


def test_ties_are_deterministic():
    groups = [[Option(5, 1.0), Option(5, 1.0), Option(3, 1.0)]] * 3
    assert solve(groups, 100).choice == (2, 2, 2)  # equal error: the cheaper option
    groups = [[Option(5, 1.0), Option(5, 1.0)]] * 3
    assert solve(groups, 100).choice == (0, 0, 0)


def test_empty_group_refused():
    with pytest.raises(ValueError):
        solve([[]], 10)
