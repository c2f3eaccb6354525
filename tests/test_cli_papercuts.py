"""Command-line papercuts (issue 21 item 17): one suggestion for a misspelled option, plain words
for a value of the wrong type, combinations that would be ignored refused, JSON errors under
--json, -V, examples in --help, and progress names that keep the layer index."""

from __future__ import annotations

import pytest

from faults import assert_one_line_error


def test_a_misspelled_option_gets_the_one_closest_suggestion(run_cli, tmp_path):
    line = assert_one_line_error(*run_cli("convert", tmp_path, tmp_path / "o", "--recpie", "nvfp4"),
                                 "--recpie", "did you mean --recipe?")
    assert " or " not in line  # was: --recipe or --resume or --device
    line = assert_one_line_error(*run_cli("convert", tmp_path, tmp_path / "o", "--zzzzzz", "x"), "--zzzzzz")
    assert "did you mean" not in line  # nothing is close


@pytest.mark.parametrize("argv, said", [
    (["verify", "q", "--top", "abc"], "--top 'abc': not an integer"),
    (["verify", "q", "--top=abc"], "--top 'abc': not an integer"),
    (["verify", "q", "--top", "-1"], "--top '-1': must be at least 0"),
    (["convert", "s", "d", "--workers", "0"], "--workers '0': must be at least 1"),
])
def test_a_bad_value_is_said_in_plain_words(run_cli, argv, said):
    line = assert_one_line_error(*run_cli(*argv), said)
    assert "Input should be" not in line and "unable to parse" not in line
