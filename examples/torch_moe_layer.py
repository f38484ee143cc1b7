"""A PyTorch MoE layer on cuep, checked against a plain dense torch computation of the same layer.

One process drives every local GPU (one expert-parallel rank per GPU; one GPU works too). Per rank:

    x [N, H] bf16 --router--> top-k ids / weights --cuep.dispatch--> rows grouped by local expert
      --torch matmuls per expert (SwiGLU)--> expert_out [capacity, H] --cuep.combine--> out [N, H]

Everything stays in torch tensors: cuep takes them zero-copy and returns torch views of its buffer, on torch's
current stream. The dense reference runs every expert on every token in float32 and masks by the routing.
Prints the error per rank and PASS or FAIL (exit status 1 on failure).

    python examples/torch_moe_layer.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import cuep
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import cuep

H, I, E, K, T = 1024, 512, 32, 4, 128  # hidden, expert width, experts, top-k, max tokens per rank
TOL = 2e-2  # relative Frobenius error of bf16 expert GEMMs against float32


def route(x, router):
    """Softmax router, top-k, weights renormalised: (int32 [N, K] ids, float32 [N, K] weights)."""
    probs = (x.float() @ router).softmax(dim=-1)
    weights, ids = probs.topk(K, dim=-1)
    return ids.to(torch.int32), weights / weights.sum(dim=-1, keepdim=True)


class MoELayer(torch.nn.Module):
    """Expert-parallel SwiGLU MoE: rank r holds experts r * L .. r * L + L - 1 (L = E / ranks), as dispatch places
    them; the router (float32) is replicated; the expert weights are bf16."""

    def __init__(self, buf, router, w_gate_up, w_down):
        super().__init__()
        self.buf = buf
        L = buf.cfg.n_local_experts
        self.devices = list(buf.group.devices)
        self.router = [router.to(dev) for dev in self.devices]
        self.w_gate_up = [w_gate_up[r * L:(r + 1) * L].to(dev, torch.bfloat16)
                          for r, dev in zip(buf.group.ranks, self.devices)]
        self.w_down = [w_down[r * L:(r + 1) * L].to(dev, torch.bfloat16)
                       for r, dev in zip(buf.group.ranks, self.devices)]

    def experts(self, d, i: int):
        """One rank's expert outputs [capacity, H]: row j is its expert's output of dispatched row j."""
        cfg = self.buf.cfg
        # the one host read of the layer (a grouped GEMM would read row_offsets on the device instead)
        offsets, experts = d.row_offsets.tolist(), d.expert_ids.tolist()
        y = torch.empty((cfg.capacity, cfg.hidden), dtype=torch.bfloat16, device=d.tokens.device)
        for g, e in enumerate(experts):
            a, b = offsets[g], offsets[g + 1]
            if b > a:
                h = d.tokens[a:b] @ self.w_gate_up[i][e]                      # [rows, 2I]: gate | up
                y[a:b] = (F.silu(h[:, :I]) * h[:, I:]) @ self.w_down[i][e]    # rows past offsets[-1]: not read
        return y

    def forward(self, xs: list) -> list:
        routed = [route(x, router) for x, router in zip(xs, self.router)]
        d = cuep.dispatch(self.buf, xs, [r[0] for r in routed], [r[1] for r in routed])
        ys = [self.experts(di, i) for i, di in enumerate(d)]
        out = cuep.combine(self.buf, ys, d)  # weights rode along with dispatch
        return [o.clone() for o in out]      # the buffer's output is reused by the next combine


def dense_reference(x, router, w_gate_up, w_down):
    """Every expert on every token in float32, masked by the same routing."""
    x = x.float()
    ids, weights = route(x, router)
    gate = torch.zeros((x.shape[0], E), device=x.device).scatter_(1, ids.long(), weights)
    out = torch.zeros((x.shape[0], H), device=x.device)
    for e in range(E):
        h = x @ w_gate_up[e].float()
        out += gate[:, e:e + 1] * ((F.silu(h[:, :I]) * h[:, I:]) @ w_down[e].float())
    return out


def main() -> int:
    group = cuep.init()  # all local GPUs, one rank each
    R = group.n_ranks
    cfg = cuep.EPConfig(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T, n_gpus_per_node=R)
    buf = cuep.Buffer(group, cfg)
    gen = torch.Generator().manual_seed(0)
    router = torch.randn((H, E), generator=gen) / H**0.5
    w_gate_up = (torch.randn((E, H, 2 * I), generator=gen) / H**0.5).to(torch.bfloat16)
    w_down = (torch.randn((E, I, H), generator=gen) / I**0.5).to(torch.bfloat16)
    layer = MoELayer(buf, router, w_gate_up, w_down)
    xs = [torch.randn((T - 17 * (r % 4), H), generator=gen).to(dev, torch.bfloat16)
          for r, dev in enumerate(group.devices)]
    with torch.no_grad():
        out = layer(xs)
        ok = True
        for r, (x, o, dev) in enumerate(zip(xs, out, group.devices)):
            want = dense_reference(x, router.to(dev), w_gate_up.to(dev), w_down.to(dev))
            err = float((o.float() - want).norm() / want.norm())
            max_err = float((o.float() - want).abs().max())
            ok &= err < TOL
            print(f"rank {r} (GPU {dev}, {x.shape[0]} tokens): max |out - dense| = {max_err:.3e}, "
                  f"relative error {err:.2e}")
    buf.synchronize()
    print(f"{'PASS' if ok else 'FAIL'}: {R} rank(s), H={H} I={I} E={E} top-{K}, bf16 against float32 (< {TOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
