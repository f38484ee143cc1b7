"""Every notebook, executed top to bottom on the GPU machine through scripts/run_notebooks.py: no cell fails.

``CUEP_NOTEBOOK_OUT=DIR`` keeps the executed copies (with their outputs and plots) in DIR, so the run that tests
them also produces the copies committed under notebooks/.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.gpu
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom_on_the_gpu(path, tmp_path):
    out_dir = Path(os.environ.get("CUEP_NOTEBOOK_OUT", tmp_path))
    out_dir.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "run_notebooks.py"), str(path), "--out-dir",
                          str(out_dir), "--cell-timeout", "400"], capture_output=True, text=True, cwd=REPO,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    nb = json.loads((out_dir / path.name).read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    outputs = [o for c in code for o in c["outputs"]]
    assert code and all(c.get("execution_count") for c in code), "every code cell ran"
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert outputs, "the notebook printed or plotted something"
