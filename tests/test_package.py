"""What ``import cuep`` gives and costs, measured in a fresh interpreter (CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: times the import alone and reports what it brought in.
PROBE = """
import json, sys, time
t0 = time.perf_counter()
import cuep
seconds = time.perf_counter() - t0
print(json.dumps({
    "seconds": seconds,
    "submodules": {name: type(getattr(cuep, name, None)).__name__ for name in ("ops", "reference", "moe")},
    "in_all": [name for name in ("ops", "reference", "moe") if name in cuep.__all__],
    "has": {"ops.quantize": hasattr(cuep.ops, "quantize"), "reference.dispatch": hasattr(cuep.reference, "dispatch"),
            "moe.moe_forward": hasattr(cuep.moe, "moe_forward")},
    "torch": "torch" in sys.modules,
    "cupy": "cupy" in sys.modules,
}))
"""


def _import_cuep() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_import_cuep_gives_submodules_and_stays_cheap():
    _import_cuep()  # a first import may compile the .pyc files; the second one is what every later import costs
    got = _import_cuep()
    assert got["submodules"] == {"ops": "module", "reference": "module", "moe": "module"}
    assert got["in_all"] == ["ops", "reference", "moe"]
    assert all(got["has"].values()), got["has"]
    assert not got["torch"], "import cuep imported torch"
    # cuep/ops.py, moe.py, ep.py, buffer.py and group.py import CuPy inside the functions that need it
    assert not got["cupy"], "import cuep imported cupy (import it inside the function that needs it)"
    assert got["seconds"] < 1.0, f"import cuep took {got['seconds']:.3f} s"
