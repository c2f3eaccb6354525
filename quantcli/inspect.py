"""Transitional alias, to be deleted: reformat.py still imports `describe_module` from here and
reads its result as a dict. The analysis lives in quantcli/analysis.py (dataclasses) and the
inspect report in quantcli/inspect_report.py; once reformat.py imports
`quantcli.analysis.describe_module`, this module goes (it shadows the standard library's name)."""

from __future__ import annotations

from . import analysis
from .reports import to_json


def describe_module(layout, module: str, recipe_name: str, tensors, config: dict | None = None,
                    scale_rule: str | None = None) -> dict:
    return to_json(analysis.describe_module(layout, module, recipe_name, tensors, scale_rule))
