"""quantcli/cli/grouping.py: rows grouped by layer pattern, exactly (every member named, nothing more)."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from quantcli.cli.grouping import braces, group_names, natural_key, short_prefix


def expand(pattern: str) -> set[str]:
    """Every name a pattern stands for (the inverse the tests check exactness against)."""
    parts = []
    for part in re.findall(r"(?:\{[^}]*\}|[^.{])+", pattern):
        if part.startswith("{"):
            values = []
            for item in part[1:-1].split(","):
                lo, _, hi = item.partition("..")
                values += range(int(lo), int(hi or lo) + 1)
            parts.append([str(v) for v in values])
        else:
            parts.append([part])
    return {".".join(p) for p in itertools.product(*parts)}


def assert_exact(names, keys=None):
    groups = group_names(names, keys)
    assert sorted(m for g in groups for m in g.members) == list(range(len(names)))  # each row once
    for g in groups:
        assert expand(g.pattern) == {names[m] for m in g.members}, g.pattern
        if keys is not None:
            assert len({keys[m] for m in g.members}) == 1
    assert len({g.pattern for g in groups}) == len(groups) or keys is not None
    return groups


@pytest.mark.parametrize("values, text", [([5], "5"), ([0, 1], "{0,1}"), ([0, 1, 2, 3], "{0..3}"),
                                          ([0, 1, 2, 3, 5], "{0..3,5}"), ([7, 1, 3, 2], "{1..3,7}"),
                                          ([0, 2, 4], "{0,2,4}")])
def test_braces(values, text):
    assert braces(values) == text


def test_moe_layers_and_experts_make_one_row_per_projection():
    names = [f"model.layers.{layer}.mlp.experts.{e}.{p}" for layer in range(32) for e in range(64)
             for p in ("down_proj", "gate_proj", "up_proj")]
    groups = assert_exact(names)
    assert [(g.pattern, g.count) for g in groups] == [
        ("model.layers.{0..31}.mlp.experts.{0..63}.down_proj", 2048),
        ("model.layers.{0..31}.mlp.experts.{0..63}.gate_proj", 2048),
        ("model.layers.{0..31}.mlp.experts.{0..63}.up_proj", 2048)]


def test_a_missing_layer_is_left_out_of_the_range():
    names = [f"model.layers.{i}.self_attn.q_proj" for i in (0, 1, 2, 3, 5)]
    assert [g.pattern for g in assert_exact(names)] == ["model.layers.{0..3,5}.self_attn.q_proj"]


def test_a_missing_expert_splits_the_box_instead_of_widening_it():
    names = [f"layers.{layer}.experts.{e}.w1" for layer in range(4) for e in range(8) if (layer, e) != (2, 7)]
    groups = assert_exact(names)
    assert {g.pattern for g in groups} == {"layers.{0,1,3}.experts.{0..7}.w1", "layers.2.experts.{0..6}.w1"}


def test_rows_group_only_when_their_other_columns_agree():
    names = [f"model.layers.{i}.mlp.down_proj" for i in range(6)]
    keys = ["nvfp4", "nvfp4", "fp8", "nvfp4", "nvfp4", "nvfp4"]
    groups = assert_exact(names, keys)
    assert [(g.pattern, [keys[m] for m in g.members][0]) for g in groups] == [
        ("model.layers.{0,1,3..5}.mlp.down_proj", "nvfp4"), ("model.layers.2.mlp.down_proj", "fp8")]


def test_names_without_indices_and_leading_zeros_stay_as_they_are():
    names = ["lm_head", "model.norm", "model.layers.01.x", "model.layers.1.x"]
    groups = assert_exact(names)
    assert sorted(g.pattern for g in groups) == ["lm_head", "model.layers.01.x", "model.layers.1.x", "model.norm"]


def test_groups_come_in_natural_order():
    names = [f"model.layers.{i}.mlp" for i in (10, 2)] + ["model.layers.2.attn", "model.embed"]
    keys = ["a", "b", "a", "a"]
    assert [g.pattern for g in group_names(names, keys)] == [
        "model.embed", "model.layers.2.attn", "model.layers.2.mlp", "model.layers.10.mlp"]
    assert natural_key("layers.2") < natural_key("layers.10") < natural_key("layers.x")


def test_random_sets_are_always_covered_exactly():
    rng = random.Random(0)
    for _ in range(200):
        points = {(a, b, c) for a in range(4) for b in range(5) for c in range(3) if rng.random() < 0.7}
        names = [f"m.{a}.e.{b}.p.{c}" for a, b, c in sorted(points)]
        if names:
            assert_exact(names, [rng.choice("xy") for _ in names])


def test_short_prefix_is_shared_by_most_names_and_keeps_every_tail():
    names = ["model.layers.{0..31}.mlp.experts.{0..63}.down_proj", "model.layers.{0..31}.self_attn.q_proj",
             "lm_head", "model.norm"]
    assert short_prefix(names) == "model.layers.{0..31}."
    assert short_prefix(["a.b", "a.c"]) == "a."
    assert short_prefix(["x", "y"]) == "" and short_prefix([]) == ""
