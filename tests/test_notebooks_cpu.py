"""The notebooks without a GPU: valid nbformat-4 JSON whose stored outputs hold no error, valid Python, public API only; the formats
notebook (which falls back to cuep.reference on the CPU) and the benchmarks notebook (which skips its live run and
shows the committed reference results) run end to end through scripts/run_notebooks.py.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import cuep
import cuep.bench
import cuep.bench.__main__
import cuep.bench.internode_model
import cuep.bench.report
import cuep.moe
import cuep.nvshmem
import cuep.ops
import cuep.reference

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
RUNNER = REPO / "scripts" / "run_notebooks.py"
# cuep's public modules besides cuep itself, by their path under cuep. Of cuep.bench only the command line
# (__main__: make_plan, describe_plan, run, print_report, write_outputs, ...) and report (tables, JSON, plots) are
# public; its measuring internals (cases, timing, nccl, ceilings, traffic, kernels) are not.
PUBLIC_MODULES = {"ops": cuep.ops, "reference": cuep.reference, "moe": cuep.moe, "bench": cuep.bench,
                  "bench.__main__": cuep.bench.__main__, "bench.report": cuep.bench.report,
                  "bench.internode_model": cuep.bench.internode_model, "nvshmem": cuep.nvshmem}


def public_names(module) -> set[str]:
    """``__all__``, else the names without a leading underscore that are not modules (a package's submodules are
    public only if PUBLIC_MODULES lists them)."""
    return set(getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")
                                                    and not isinstance(getattr(module, n), types.ModuleType)])


def _public_module(path: tuple[str, ...]) -> bool:
    return len(path) > 1 and path[0] == "cuep" and ".".join(path[1:]) in PUBLIC_MODULES


def _source(cell) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def code_cells(path: Path) -> list[str]:
    return [_source(c) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


# ---- the public-API check -------------------------------------------------------------------------------------------
def _module_path(module: str) -> tuple[str, ...] | None:
    """("cuep",) or ("cuep", "moe") for an allowed cuep module name; None for another package; "bad" otherwise."""
    parts = tuple(module.split("."))
    if parts[0] != "cuep":
        return None
    if len(parts) == 1 or _public_module(parts):
        return parts
    return ("bad",)


def api_violations(source: str) -> list[str]:
    """Every use of cuep in ``source`` that is not public: ``cuep.<name>`` outside ``cuep.__all__`` and the modules
    of PUBLIC_MODULES (ops / reference / moe, cuep.bench's command line and report), a name of those modules that
    is not public, a private submodule import, or any ``._private`` attribute access."""
    tree = ast.parse(source)
    aliases: dict[str, tuple[str, ...]] = {}
    bad: list[str] = []

    def check_name(path: tuple[str, ...], name: str, where: str) -> tuple[str, ...] | None:
        """``name`` looked up in the cuep module ``path``; returns its module path if it is a public module."""
        if _public_module(path + (name,)):
            return path + (name,)
        if path == ("cuep",):
            if name not in cuep.__all__:
                bad.append(f"{where}: cuep.{name} is not in cuep.__all__")
        elif name not in public_names(PUBLIC_MODULES[".".join(path[1:])]):
            bad.append(f"{where}: {'.'.join(path)}.{name} is not public")
        return None

    for node in ast.walk(tree):  # imports first: they define the aliases the attribute check resolves
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for a in node.names:
                path = _module_path(a.name)
                if path == ("bad",):
                    bad.append(f"{where}: import {a.name} (not a public module)")
                elif path is not None:
                    aliases[a.asname or "cuep"] = path if a.asname else ("cuep",)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            path = _module_path(node.module)
            if path == ("bad",):
                bad.append(f"{where}: from {node.module} import ... (not a public module)")
            elif path is not None:
                for a in node.names:
                    sub = check_name(path, a.name, where)
                    if sub is not None:
                        aliases[a.asname or a.name] = sub

    def resolve(expr) -> tuple[str, ...] | None:
        if isinstance(expr, ast.Name):
            return aliases.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = resolve(expr.value)
            if base is not None and _public_module(base + (expr.attr,)):
                return base + (expr.attr,)
        return None

    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        where = f"line {node.lineno}"
        if node.attr.startswith("_") and not (node.attr.startswith("__") and node.attr.endswith("__")):
            bad.append(f"{where}: private attribute .{node.attr}")
            continue
        base = resolve(node.value)
        if base is not None:
            check_name(base, node.attr, where)
    return bad


@pytest.mark.parametrize("source, n_bad", [
    ("import cuep\ncuep.dispatch; cuep.moe.moe_forward; cuep.ops.quantize; cuep.reference.dispatch", 0),
    ("from cuep import moe, EPConfig\nmoe.init_weights; from cuep.moe import route", 0),
    ("import cuep.moe as m\nm.moe_reference\nimport numpy\nnumpy.linalg.norm", 0),
    ("import cuep\ncuep.ep.dispatch", 1),
    ("import cuep\ncuep.moe._expert_outputs", 1),
    ("from cuep.formats import FORMATS", 1),
    ("from cuep import buffer", 1),
    ("import cuep.group", 1),
    ("from cuep.moe import _mlp_f32", 1),
    ("from cuep import reference as ref\nref.fp8_scales_as_float(x)", 1),
    ("buf._ranks[0].tokens", 1),
    ("from cuep.bench import __main__ as cli, report\ncli.make_plan; cli.run; cli.OPS; report.table", 0),
    ("import cuep.bench.report\ncuep.bench.report.plot_sweep; cuep.bench.__main__.describe_plan", 0),
    ("from cuep.bench.__main__ import make_plan, run", 0),
    ("from cuep.bench import cases", 1),
    ("import cuep.bench.timing", 1),
    ("import cuep.bench\ncuep.bench.nccl.NcclComms", 1),
    ("from cuep.bench import report\nreport.json.dumps", 1),
    ("from cuep.bench import __main__ as cli\ncli._progress", 1),
])
def test_api_check_catches_private_uses(source, n_bad):
    assert len(api_violations(source)) == n_bad, api_violations(source)


# ---- the notebooks --------------------------------------------------------------------------------------------------
def test_the_four_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_formats.ipynb", "03_moe_layer.ipynb",
                                           "04_benchmarks.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_nbformat4_and_ran_cleanly(path):
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4 and isinstance(nb["nbformat_minor"], int)
    assert nb["metadata"]["kernelspec"]["language"] == "python"
    cells = nb["cells"]
    assert cells[0]["cell_type"] == "markdown", "a notebook opens with a markdown cell saying what it does"
    assert sum(c["cell_type"] == "markdown" for c in cells) >= 4
    for c in cells:
        assert c["cell_type"] in ("markdown", "code")
        assert isinstance(c["source"], (str, list)) and isinstance(c["metadata"], dict)
        if c["cell_type"] == "code":  # committed as executed on the GPU machine: outputs allowed, errors never
            assert isinstance(c["outputs"], list)
            assert not [o for o in c["outputs"] if o.get("output_type") == "error"], "a committed cell failed"
    try:
        import nbformat
    except ImportError:
        return
    nbformat.validate(nbformat.reads(path.read_text(), as_version=4))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_is_python_using_only_the_public_api(path):
    cells = code_cells(path)
    assert cells
    for i, src in enumerate(cells):
        ast.parse(src, filename=f"{path.name} code cell {i}")
    problems = api_violations("\n".join(cells))
    assert not problems, f"{path.name}: {problems}"
    assert "import cuep" in "\n".join(cells)


def _run(args, **kw):
    return subprocess.run([sys.executable, str(RUNNER), *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=300, **kw)


def test_formats_notebook_runs_on_the_cpu(tmp_path):
    """02_formats falls back to cuep.reference without a GPU (and to tables without matplotlib)."""
    path = REPO / "notebooks" / "02_formats.ipynb"
    res = _run([path, "--out-dir", tmp_path])
    assert res.returncode == 0, res.stdout + res.stderr
    nb = json.loads((tmp_path / path.name).read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    text = "".join("".join(o.get("text", [])) for o in outputs)
    for fmt in cuep.FORMATS:
        assert fmt in text
    assert "rel. RMS error" in text


def test_benchmarks_notebook_runs_on_the_cpu(tmp_path):
    """04_benchmarks with no GPU visible: says so, skips the live run, prints (and, with matplotlib, plots) the
    committed 2 x H200 reference results."""
    path = REPO / "notebooks" / "04_benchmarks.ipynb"
    res = _run([path, "--out-dir", tmp_path], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stdout + res.stderr
    nb = json.loads((tmp_path / path.name).read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    text = "".join("".join(o.get("text", [])) for o in outputs)
    assert "the live run needs two or more" in text
    assert "2 x NVIDIA H200" in text and "peer copy GB/s" in text
    for column in ("cuep us", "NCCL us", "x NCCL", "of peer"):
        assert column in text
    assert "4096 prefill" in text and "128 decode" in text


def test_runner_records_outputs_and_stops_at_the_first_error(tmp_path):
    cells = [("markdown", "# t"), ("code", "x = 2\nprint('hello')\nx * 21"), ("code", "raise ValueError('boom')"),
             ("code", "print('never')")]
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
          "cells": [{"cell_type": k, "metadata": {}, "source": s, **({"outputs": [], "execution_count": None}
                                                                     if k == "code" else {})} for k, s in cells]}
    src = tmp_path / "t.ipynb"
    src.write_text(json.dumps(nb))
    res = _run([src, "--out-dir", tmp_path / "out"])
    assert res.returncode == 1 and "boom" in res.stderr
    done = json.loads((tmp_path / "out" / "t.ipynb").read_text())["cells"]
    assert done[1]["outputs"][0] == {"output_type": "stream", "name": "stdout", "text": ["hello\n"]}
    assert done[1]["outputs"][1]["data"]["text/plain"] == ["42"]
    assert done[2]["outputs"][-1]["output_type"] == "error" and done[2]["outputs"][-1]["ename"] == "ValueError"
    assert done[3]["outputs"] == [] and done[3]["execution_count"] is None
