"""Execute notebooks top to bottom and write copies with their outputs, in plain Python (no Jupyter needed).

usage: python scripts/run_notebooks.py [NOTEBOOK ...] [--out-dir DIR | --inplace] [--cell-timeout S] [--nbclient]

Without arguments it runs ``notebooks/*.ipynb``. Each notebook's code cells run in order in one fresh namespace
with ``exec`` (the repository root on ``sys.path``): what a cell prints becomes a ``stream`` output, the value of
its last expression an ``execute_result``, and every matplotlib figure open after it (Agg backend; ``plt.show()``
does nothing) a PNG ``display_data``. The first failing cell stops that notebook: its traceback is printed and
stored as an ``error`` output, the notebook is still written, and the exit status is 1. ``--nbclient`` runs the
notebooks in a Jupyter kernel instead (needs nbformat, nbclient and ipykernel).
"""
from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import io
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _setup_matplotlib():
    """pyplot on the Agg backend with show() a no-op, or None when matplotlib is not installed."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    plt.show = lambda *args, **kwargs: None
    return plt


def _figures(plt) -> list[dict]:
    """Every open figure as a PNG display_data output; the figures are closed."""
    if plt is None:
        return []
    outputs = []
    for num in plt.get_fignums():
        fig = plt.figure(num)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=90, bbox_inches="tight")
        outputs.append({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": base64.b64encode(png.getvalue()).decode(),
                                 "text/plain": [repr(fig)]}})
    plt.close("all")
    return outputs


class _CellTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _CellTimeout("cell timed out")


def _run_cell(source: str, namespace: dict, name: str, timeout_s: int):
    """exec one cell; returns (stdout, stderr, last expression's value or None, exception or None)."""
    tree = ast.parse(source, filename=name)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    out, err = io.StringIO(), io.StringIO()
    value, exc = None, None
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(compile(tree, name, "exec"), namespace)
            if last is not None:
                value = eval(compile(last, name, "eval"), namespace)
    except BaseException as e:  # noqa: BLE001  (a notebook cell may raise anything; report it)
        if isinstance(e, KeyboardInterrupt):
            raise
        exc = e
    finally:
        signal.alarm(0)
    return out.getvalue(), err.getvalue(), value, exc


def run_plain(path: Path, out_path: Path, timeout_s: int, plt) -> bool:
    nb = json.loads(path.read_text())
    namespace = {"__name__": "__main__"}
    count, ok = 0, True
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        if not ok:  # cells after a failure are left unexecuted, as Jupyter does
            cell["outputs"], cell["execution_count"] = [], None
            continue
        count += 1
        source = "".join(cell["source"])
        t0 = time.perf_counter()
        stdout, stderr, value, exc = _run_cell(source, namespace, f"{path.name}[cell {i}]", timeout_s)
        outputs = []
        if stdout:
            outputs.append({"output_type": "stream", "name": "stdout", "text": _lines(stdout)})
        if stderr:
            outputs.append({"output_type": "stream", "name": "stderr", "text": _lines(stderr)})
        if value is not None:
            outputs.append({"output_type": "execute_result", "execution_count": count, "metadata": {},
                            "data": {"text/plain": _lines(repr(value))}})
        outputs += _figures(plt)
        if exc is not None:
            tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
            outputs.append({"output_type": "error", "ename": type(exc).__name__, "evalue": str(exc),
                            "traceback": [line.rstrip("\n") for line in tb]})
            print(f"{path.name}: cell {i} failed\n{stdout}{stderr}{''.join(tb)}", file=sys.stderr)
            ok = False
        cell["outputs"], cell["execution_count"] = outputs, count
        print(f"{path.name}: cell {i} {'ok' if exc is None else 'FAILED'} ({time.perf_counter() - t0:.1f} s)")
    out_path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return ok


def run_nbclient(path: Path, out_path: Path, timeout_s: int) -> bool:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO)}})
    ok = True
    try:
        client.execute()
    except CellExecutionError as e:
        print(f"{path.name}: {e}", file=sys.stderr)
        ok = False
    nbformat.write(nb, out_path)
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*", type=Path)
    p.add_argument("--out-dir", type=Path, default=REPO / "build" / "notebooks",
                   help="where the executed copies go (default build/notebooks)")
    p.add_argument("--inplace", action="store_true", help="write the outputs into the notebooks themselves")
    p.add_argument("--cell-timeout", type=int, default=600, help="seconds per cell")
    p.add_argument("--nbclient", action="store_true", help="run in a Jupyter kernel through nbclient")
    args = p.parse_args(argv)
    paths = args.notebooks or sorted((REPO / "notebooks").glob("*.ipynb"))
    if not paths:
        p.error("no notebooks found")
    sys.path.insert(0, str(REPO))
    plt = None if args.nbclient else _setup_matplotlib()
    if not args.inplace:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for path in paths:
        out_path = path if args.inplace else args.out_dir / path.name
        print(f"== {path} -> {out_path}")
        if args.nbclient:
            ok = run_nbclient(path, out_path, args.cell_timeout)
        else:
            ok = run_plain(path, out_path, args.cell_timeout, plt)
        if not ok:
            failed.append(path.name)
    print("all notebooks ran" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
