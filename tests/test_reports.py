"""Reports are typed data and only the face renders: no module outside quantcli/cli/ imports rich or
prints, and --json is the report dataclass serialized by reports.to_json."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import quantcli
from quantcli.reports import NOT_IN_JSON, OMITTED, to_json

PKG = Path(quantcli.__file__).parent
LIBRARY = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                 if p.parts[len(PKG.parts)] != "cli" and p.name not in ("testing.py", "__main__.py"))


def _imported(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.add(("." * node.level) + (node.module or ""))
            out.update(f"{'.' * node.level}{node.module or ''}.{a.name}" for a in node.names)
    return out


def test_library_modules_neither_print_nor_import_the_face():
    for rel in LIBRARY:
        names = _imported(PKG / rel)
        assert not any(n.split(".")[0] == "rich" for n in names), f"{rel} imports rich"
        assert not any(n.startswith("quantcli.cli") for n in names), f"{rel} imports the face"
        assert not re.search(r"(?<![\w.])print\(", (PKG / rel).read_text()), f"{rel} prints"


def test_to_json_drops_omitted_and_hidden_fields_keeps_null_and_order():
    @dataclass
    class Inner:
        a: int
        b: float | None = OMITTED

    @dataclass
    class Outer:
        z: list
        y: dict
        hidden: dict = field(default_factory=dict, metadata=NOT_IN_JSON)
        x: float | None = None

    doc = to_json(Outer(z=[Inner(1), Inner(2, None)], y={"k": Inner(3, 0.5)}, hidden={"secret": 1}))
    assert list(doc) == ["z", "y", "x"] and doc["x"] is None
    assert doc["z"] == [{"a": 1}, {"a": 2, "b": None}] and doc["y"] == {"k": {"a": 3, "b": 0.5}}


def _body(doc: dict) -> dict:
    """The document without what the command adds to the report (tests/test_json_schema.py checks those)."""
    # inspect adds `excluded` ([{module, reason}] of its exclusion_list), verify `thresholds`
    added = {"quantcli_version", "schema_version", "command", "destination", "thresholds", "excluded"}
    body = {k: v for k, v in doc.items() if k not in added}
    if "checkpoint" in body:
        body.pop("source")  # verify's source is its reference, already in the report
    return body


def test_inspect_json_is_the_report_serialized(tmp_path, run_cli):
    from quantcli.inspect import inspect_checkpoint, kv_cache_account
    from quantcli.testing import make_llama

    src = make_llama(tmp_path / "llama", hidden=64, layers=1, shards=1)
    dst = tmp_path / "q"
    assert run_cli("convert", src, dst, "--recipe", "nvfp4", "--quiet", "--device", "cpu")[0] == 0
    code, out, _ = run_cli("inspect", dst, "--json", "--kv-cache", "--stats")
    report = inspect_checkpoint(str(dst), stats=True)
    report.kv_cache = kv_cache_account(report.config, 80 * 2**30)
    doc = json.loads(out)
    assert code == 0 and _body(doc) == json.loads(json.dumps(to_json(report), default=str))
    assert "config" not in doc and doc["kv_cache"]["layers"] == 1
    module = doc["modules"][0]
    # a global scale carries its value; block scales have no "value" key (OMITTED, not null)
    assert all(("value" in t) == (t["role"] == "global_scale") for t in module["tensors"])
    assert "e8m0_histogram" not in module["stats"] and module["stats"]["scale_nonfinite"] == 0


def test_verify_json_is_the_report_serialized(tmp_path, run_cli):
    from quantcli.testing import make_llama
    from quantcli.verify import verify_checkpoint

    src = make_llama(tmp_path / "llama", hidden=64, layers=1, shards=1)
    dst = tmp_path / "q"
    assert run_cli("convert", src, dst, "--recipe", "fp8-block", "--quiet", "--device", "cpu")[0] == 0
    code, out, _ = run_cli("verify", dst, "--reference", src, "--json")
    report = verify_checkpoint(str(dst), reference=str(src), device="cpu")
    doc = json.loads(out)
    assert code == 0 and report.passed and _body(doc) == json.loads(json.dumps(to_json(report), default=str))
    # without --exact the rows carry no exact/scale-rule keys at all
    assert doc["tensors"] and all("exact_identical_fraction" not in r and "scale_rule_matches" not in r
                                  for r in doc["tensors"])
    assert [c["check"] for c in doc["checks"]][:2] == ["config keys the consumer needs are present",
                                                       "manifest agrees with the safetensors headers"]
