"""Regenerate docs/formats.md's generated sections ("Which engine loads which pair" from the
engines table, quantcli/formats/engines.py; "Coming from llm-compressor" from
quantcli/formats/schemes.py), or check that they are current.

    python scripts/engines_table.py           # rewrite the section in place
    python scripts/engines_table.py --check   # exit 1 if the section is stale (tests/test_engines.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantcli.formats.engines_doc import replaced  # noqa: E402

DOC = ROOT / "docs" / "formats.md"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if docs/formats.md is stale")
    args = ap.parse_args()
    text = DOC.read_text(encoding="utf-8")
    new = replaced(text)
    if args.check:
        if new != text:
            print(f"{DOC}: a generated section is stale; run python scripts/engines_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
