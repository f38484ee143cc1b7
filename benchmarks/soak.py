"""Soak: many dispatch + combine rounds in a row on GPU 0, every one checked against cuep.reference (issue 22).

    PYTHONPATH=. python3 benchmarks/soak.py --rounds 10000 --seed 1 --out out/soak

Several simulated ranks (cuep.init([0, 0, 0, 0]) and [0, 0]) and one real rank ([0]); per round a seeded generator
picks the configuration (format, fused shared expert, skip_a2a, all-reduce shares, float32 combine, staged / direct
/ mixed small rounds; one Buffer per configuration, created once), tokens per rank (0 .. T), the routing (uniform,
skewed, one hot expert, ranks that send nothing, ranks whose experts nobody picks), weights at dispatch / combine /
none, a residual, the async halves and the input dtype (tests/soak_rounds.py). Prints progress every 1000 rounds,
then the rounds per kind, the GPU memory after the warm-up and after the last round (CuPy pool used bytes and
cudaMemGetInfo free bytes; they must be equal: exit status 1 otherwise), and per configuration the median times
of its first and last 10% of rounds (printed, not judged). ``--out DIR`` writes DIR/soak.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # soak_rounds and ep_check live with the tests
try:
    import cuep  # noqa: F401
except ImportError:  # run from a checkout
    sys.path.insert(0, os.path.join(HERE, ".."))
    import cuep  # noqa: F401

import soak_rounds  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--configs", type=int, default=None,
                   help="use this many configurations (covering every group, format, option and mode); default all")
    p.add_argument("--progress", type=int, default=1000, help="a progress line every this many rounds")
    p.add_argument("--out", default=None, help="directory for soak.json")
    a = p.parse_args(argv)
    s = soak_rounds.run(a.seed, a.rounds, a.configs, progress_every=a.progress, log=lambda m: print(m, flush=True))
    print(f"\n{s['rounds']} rounds, seed {s['seed']}, {len(s['configs'])} configs, device {s['device']}: "
          f"{s['elapsed_s']:.1f} s ({s['ms_per_round']:.2f} ms per round, reference and checks included)")
    print("rounds per kind:")
    for kind, c in s["counts"].items():
        print(f"  {kind:<22} " + ", ".join(f"{k}: {v}" for k, v in sorted(c.items())))
    b, e = s["memory_before"], s["memory_after"]
    same = b["pool_used_bytes"] == e["pool_used_bytes"] and b["free_bytes"] == e["free_bytes"]
    print(f"GPU memory after warm-up: pool used {b['pool_used_bytes']} B, free {b['free_bytes']} B; after the last "
          f"round: pool used {e['pool_used_bytes']} B, free {e['free_bytes']} B -> {'equal' if same else 'DIFFERENT'}")
    print("time per round, first vs last 10% of each configuration's rounds (medians; not judged):")
    print(soak_rounds.drift_table(s))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "soak.json"), "w") as f:
            json.dump(s, f, indent=1)
        print(f"wrote {os.path.join(a.out, 'soak.json')}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
