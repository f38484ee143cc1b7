"""Instruction roofline of the fused SwiGLU and quantize kernels, from their sm_90 SASS (no GPU needed).

    python scripts/silu_roofline.py [--gpu h200|h100] [--kernels REGEX] [--show KERNEL] [--json]

Compiles cuep/cuda_src/silu.cu and quantize.cu exactly as the CPU compile test does (cuep._kernels.nvcc_command:
the runtime's options plus the ones CuPy adds), disassembles every fused_silu_* / quantize_* kernel (nvdisasm or
cuobjdump: from PATH, the CUDA toolkit, or the pip packages nvidia-cuda-nvdisasm / nvidia-cuda-cuobjdump) and finds
its steady-state loop iteration:

* the hot block H = the basic block with the most float32 instructions (the fully unrolled encode of a whole span);
* the load block L = the block with the most global loads (LDG / LDGSTS: cp.async) in H's strongly connected part;
* one iteration = the cheapest cycle H -> L -> H of the control-flow graph, weighted by instructions (Dijkstra):
  a lower bound on what one span costs, which is also the common path (rarer paths, a new row set, a group boundary,
  a span past the row's end, add instructions). Per-item work done once per several spans is not in it.
  A kernel whose rare path has more float32 instructions than its common one shows the rare path: quantize_mxfp4_bf16
  (its common path computes on bf16 pairs, HFMA2 / HMNMX2; a warp holding a block with e < -100 takes float32 lines)
  reports the float32 lines.

Elements per lane per iteration = the payload bytes its widest global stores write / output bytes per element.
Per variant it prints warp instructions per 32 elements (= per-thread instructions per element) by class, and the
bounds, as GB/s of the op's own bytes (read + written, scales included):
  issue  one warp instruction per cycle per sub-partition: SMs x 4 x clock x 32 / instr_per_element elements/s;
  alu    the ALU pipe (integer / logic / FMNMX / FSETP / conversions F2FP...) takes 16 lanes per cycle per
         sub-partition: 2 cycles per warp instruction;
  mufu   MUFU takes 4 lanes per cycle per sub-partition: 8 cycles per warp instruction;
  copy   the measured copy bandwidth (BENCHMARKS.md).
The binding bound is the smallest. These are ceilings: latency that the resident warps cannot hide comes on top.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuep import _kernels  # noqa: E402

# Copy bandwidth (GB/s, measured: BENCHMARKS.md / issue 24), SMs, boost clock (GHz).
GPUS = {
    "h200": {"copy_gbps": 4224.0, "sms": 132, "clock_ghz": 1.98},
    "h100": {"copy_gbps": 3001.0, "sms": 132, "clock_ghz": 1.98},
}
SUB_PARTITIONS = 4  # per SM, one warp instruction issued per cycle each
ALU_CYCLES = 2      # per warp instruction on the 16-lane ALU pipe
MUFU_CYCLES = 8     # per warp instruction on the 4-lane MUFU (XU) pipe

# Instruction classes, by opcode (the part before the first '.').
CLASSES = [
    ("fp32", {"FFMA", "FMUL", "FADD", "FFMA32I", "FMUL32I", "FADD32I", "FSWZADD"}),
    ("fp32-alu", {"FMNMX", "FSETP", "FSEL", "FSET", "FCHK"}),
    ("imad", {"IMAD", "IMAD32I", "IMADSP", "IMUL", "IMUL32I"}),
    ("int-alu", {"IADD3", "IADD", "IADD32I", "LOP3", "LOP", "LOP32I", "SHF", "SHL", "SHR", "LEA", "SEL", "ISETP",
                 "IMNMX", "PRMT", "BFE", "BFI", "FLO", "POPC", "BREV", "PLOP3", "P2R", "R2P", "VIMNMX", "IABS",
                 "ISCADD", "MOV", "MOV32I", "CS2R", "S2R", "S2UR", "VOTE", "VOTEU", "R2UR", "UMOV", "IADD3",
                 "ULDC", "UIADD3", "ULOP3", "USHF", "ULEA", "UISETP", "USEL", "UIMAD", "UPRMT", "UFLO", "UPOPC"}),
    ("convert", {"F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "FRND", "HADD2", "HFMA2", "HMUL2"}),
    ("mufu", {"MUFU"}),
    ("load", {"LDG", "LD", "LDGSTS", "LDS", "LDC", "LDSM", "LDL", "ULDC", "LDGDEPBAR", "DEPBAR", "CCTL"}),
    ("store", {"STG", "ST", "STS", "STL", "RED", "ATOM", "ATOMS", "ATOMG"}),
    ("shuffle", {"SHFL"}),
    ("branch", {"BRA", "BRX", "JMP", "EXIT", "RET", "CALL", "BSSY", "BSYNC", "WARPSYNC", "BAR", "NOP", "YIELD",
                "BMOV", "BREAK", "WARPGROUP", "ELECT"}),
]
# Pipes (the sm_80/sm_90 model): the FMA pipe takes FFMA/FMUL/FADD/IMAD/HFMA2 at one warp instruction per cycle;
# the ALU pipe takes the integer and logic ops, FMNMX, FSETP, FSEL, F2FP at half that; MUFU an eighth.
ALU_OPS = (CLASSES[1][1] | CLASSES[3][1] | {"F2FP", "I2FP", "F2IP"}) - {"ULDC", "UIADD3", "ULOP3", "USHF", "ULEA",
                                                                      "UISETP", "USEL", "UIMAD", "UMOV", "UPRMT",
                                                                      "UFLO", "UPOPC", "S2UR", "R2UR", "VOTEU",
                                                                      "CS2R", "S2R"}


def op_class(op: str) -> str:
    base = op.split(".")[0]
    for name, ops in CLASSES:
        if base in ops:
            return name
    return "other"


@dataclass
class Instr:
    addr: int
    text: str
    op: str           # full opcode, modifiers included (FADD.FTZ)
    pred: str         # '' or '@P0' ...
    target: str | None = None  # branch label


@dataclass
class Block:
    label: str
    instrs: list = field(default_factory=list)
    succ: list = field(default_factory=list)


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+|\.L_\w+):")
_TARGET = re.compile(r"`\((\.L_\w+)\)")


def find_tool(name: str) -> str | None:
    """nvdisasm / cuobjdump: PATH, the CUDA toolkit next to nvcc, or the pip package nvidia-cuda-<name>."""
    cands = [shutil.which(name)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(str(Path(os.path.realpath(nvcc)).parent / name))
    cands += [f"/usr/local/cuda/bin/{name}"]
    try:
        import nvidia  # namespace package of the pip CUDA wheels

        for p in nvidia.__path__:
            cands += [str(q) for q in Path(p).glob(f"*/bin/{name}")]
    except ImportError:
        pass
    # nvcc may be a wrapper script: look in the toolkits it could point to as well
    cands += [str(q) for q in Path("/usr/local").glob(f"cuda*/bin/{name}")]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def compile_cubin(filename: str, out_dir: str) -> str:
    out = os.path.join(out_dir, filename.replace(".cu", ".cubin"))
    cmd = _kernels.nvcc_command(filename, out=out)
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cmd[0] = nvcc
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{res.stdout}{res.stderr}")
    return out


def disassemble(cubin: str) -> dict[str, list]:
    """{kernel: [lines]} from nvdisasm (labels) of one cubin."""
    nvdisasm = find_tool("nvdisasm")
    if nvdisasm is None:
        raise RuntimeError("nvdisasm not found: install the CUDA toolkit's or `pip install nvidia-cuda-nvdisasm`")
    res = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(res.stderr)
    funcs: dict[str, list] = {}
    cur = None
    for line in res.stdout.splitlines():
        m = re.match(r"^\s*\.text\.(\w+):", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        if cur is not None:
            funcs[cur].append(line)
    return funcs


def parse(lines: list) -> list:
    """Basic blocks of one function (fall-through and branch edges)."""
    items = []  # ('label', name) | ('ins', Instr)
    for line in lines:
        m = _LABEL.match(line.strip())
        if m:
            items.append(("label", m.group(1)))
            continue
        m = _LINE.search(line)
        if not m:
            continue
        body = m.group(2).strip()
        pred = ""
        if body.startswith("@"):
            pred, body = body.split(None, 1)
        op = body.split()[0]
        t = _TARGET.search(body)
        items.append(("ins", Instr(int(m.group(1), 16), body, op, pred, t.group(1) if t else None)))
    blocks: list[Block] = []
    cur = Block("entry")
    for kind, v in items:
        if kind == "label":
            if cur.instrs or cur.label == "entry":
                blocks.append(cur)
            cur = Block(v)
            continue
        cur.instrs.append(v)
        base = v.op.split(".")[0]
        if base in ("BRA", "BRX", "JMP", "EXIT", "RET", "CALL"):
            blocks.append(cur)
            cur = Block(f".fall_{v.addr:x}")
    if cur.instrs:
        blocks.append(cur)
    blocks = [b for b in blocks if b.instrs]
    index = {b.label: i for i, b in enumerate(blocks)}
    for i, b in enumerate(blocks):
        last = b.instrs[-1]
        base = last.op.split(".")[0]
        uncond = last.pred in ("", "@PT") and base in ("BRA", "JMP", "EXIT", "RET") and not last.op.startswith(
            "BRA.DIV") and not re.search(r"BRA\s+!?U?P\d", last.text)
        if base in ("BRA", "JMP") and last.target in index:
            b.succ.append(index[last.target])
        if not uncond and i + 1 < len(blocks):
            b.succ.append(i + 1)
    return blocks


def _dist(blocks, src: int, dst: int) -> tuple[int, list]:
    """Cheapest path src -> ... -> dst (weights: instructions of each block entered, dst included; src not)."""
    best = {src: 0}
    prev = {}
    heap = [(0, src)]
    while heap:
        d, u = heapq.heappop(heap)
        if d > best.get(u, 1 << 60):
            continue
        for v in blocks[u].succ:
            nd = d + len(blocks[v].instrs)
            if v == dst:
                if nd < best.get(("end",), 1 << 60):
                    best[("end",)] = nd
                    prev[("end",)] = u
                continue
            if nd < best.get(v, 1 << 60):
                best[v] = nd
                prev[v] = u
                heapq.heappush(heap, (nd, v))
    if ("end",) not in best:
        return -1, []
    path = []
    u = prev[("end",)]
    while u != src:
        path.append(u)
        u = prev[u]
    return best[("end",)], path[::-1] + [dst]


def _fp32_count(b: Block) -> int:
    return sum(op_class(i.op) in ("fp32", "fp32-alu") for i in b.instrs)


def _loads(b: Block) -> int:
    return sum(i.op.split(".")[0] in ("LDG", "LDGSTS") for i in b.instrs)


def iteration(blocks) -> list:
    """The blocks of one steady-state iteration (see the module docstring), H first."""
    h = max(range(len(blocks)), key=lambda i: _fp32_count(blocks[i]))
    cand = [i for i in range(len(blocks)) if _loads(blocks[i]) and _dist(blocks, h, i)[0] >= 0
            and _dist(blocks, i, h)[0] >= 0]
    if cand:
        lo = max(cand, key=lambda i: (_loads(blocks[i]), -i))
        d1, p1 = _dist(blocks, h, lo)
        d2, p2 = _dist(blocks, lo, h)
        path = [h] + p1 + p2[:-1] if lo != h else [h] + _dist(blocks, h, h)[1][:-1]
    else:
        path = [h] + _dist(blocks, h, h)[1][:-1]
    return path


STORE_WIDTH = {"": 4, "U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def store_bytes(ins: Instr) -> int:
    mods = ins.op.split(".")[1:]
    w = 4
    for m in mods:
        if m in STORE_WIDTH and m:
            w = STORE_WIDTH[m]
    return w


def variant_info(name: str) -> dict:
    """Bytes per element read / written (scales included) and output bytes per payload element."""
    m = re.match(r"(fused_silu|quantize)_(bf16|fp8|nvfp4|mxfp4)_(bf16|f32)(_interleaved)?$", name)
    if not m:
        return {}
    op, fmt, dt = m.group(1), m.group(2), m.group(3)
    in_b = 2 if dt == "bf16" else 4
    out_b = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5, "mxfp4": 0.5}[fmt]
    scale_b = {"bf16": 0.0, "fp8": 4 / 128, "nvfp4": 1 / 16, "mxfp4": 1 / 32}[fmt]
    read = (2 if op == "fused_silu" else 1) * in_b
    return {"op": op, "fmt": fmt, "dtype": dt, "read": read, "write": out_b + scale_b, "out_b": out_b}


def analyse(name: str, lines: list, gpu: dict) -> dict | None:
    info = variant_info(name)
    if not info:
        return None
    blocks = parse(lines)
    path = iteration(blocks)
    ins = [i for b in path for i in blocks[b].instrs]
    stores = [store_bytes(i) for i in ins if i.op.split(".")[0] == "STG"]
    if not stores:
        return None
    wide = max(stores)
    elems = sum(s for s in stores if s == wide) / info["out_b"]
    by_class: dict[str, int] = {}
    for i in ins:
        c = op_class(i.op)
        by_class[c] = by_class.get(c, 0) + 1
    n = len(ins)
    alu = sum(i.op.split(".")[0] in ALU_OPS for i in ins)
    mufu = by_class.get("mufu", 0)
    ipe = n / elems
    cycles = {"issue": n / elems, "alu": ALU_CYCLES * alu / elems, "mufu": MUFU_CYCLES * mufu / elems}
    bpe = info["read"] + info["write"]
    # elements/s of one bound = SMs x sub-partitions x clock x 32 / (cycles per warp per 32 elements)
    rate = {k: gpu["sms"] * SUB_PARTITIONS * gpu["clock_ghz"] * 1e9 * 32 / v for k, v in cycles.items() if v > 0}
    gbps = {k: r * bpe / 1e9 for k, r in rate.items()}
    gbps["copy"] = gpu["copy_gbps"]
    binding = min(gbps, key=gbps.get)
    return {"kernel": name, "instr_per_iter": n, "elems_per_lane": elems, "instr_per_elem": round(ipe, 2),
            "per_elem": {k: round(v / elems, 2) for k, v in sorted(by_class.items())},
            "alu_per_elem": round(alu / elems, 2), "bytes_per_elem": round(bpe, 4),
            "gbps": {k: round(v) for k, v in gbps.items()}, "binding": binding,
            "bound_of_copy": round(min(gbps.values()) / gpu["copy_gbps"], 3),
            "blocks": [blocks[b].label for b in path]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    p.add_argument("--kernels", default=r"^(fused_silu_(fp8|nvfp4|mxfp4|bf16)_|quantize_)",
                   help="regex of kernel names")
    p.add_argument("--show", default=None, help="print the SASS of this kernel's iteration")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    gpu = GPUS[args.gpu]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for f in ("silu.cu", "quantize.cu"):
            funcs = disassemble(compile_cubin(f, tmp))
            for name in sorted(funcs):
                if not re.search(args.kernels, name):
                    continue
                r = analyse(name, funcs[name], gpu)
                if r is None:
                    continue
                rows.append(r)
                if args.show == name:
                    blocks = parse(funcs[name])
                    for b in iteration(blocks):
                        print(f"{blocks[b].label}:")
                        for i in blocks[b].instrs:
                            print(f"  {i.addr:05x}  {i.pred} {i.text}")
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.gpu}: {gpu['sms']} SMs x {SUB_PARTITIONS} issue/clk x {gpu['clock_ghz']} GHz, copy "
          f"{gpu['copy_gbps']:.0f} GB/s. instr/elem = warp instructions per 32 elements of the steady-state loop.")
    hdr = (f"{'kernel':36s} {'instr/el':>8s} {'alu/el':>6s} {'B/el':>6s} {'issue':>6s} {'alu':>6s} {'mufu':>6s} "
           f"{'copy':>6s}  binds  bound/copy  classes per element")
    print(hdr)
    for r in rows:
        g = r["gbps"]
        cls = " ".join(f"{k}={v}" for k, v in r["per_elem"].items())
        print(f"{r['kernel']:36s} {r['instr_per_elem']:8.2f} {r['alu_per_elem']:6.2f} {r['bytes_per_elem']:6.3f} "
              f"{g.get('issue', 0):6d} {g.get('alu', 0):6d} {g.get('mufu', 0):6d} {g['copy']:6d}  "
              f"{r['binding']:5s} {r['bound_of_copy']:10.0%}  {cls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
