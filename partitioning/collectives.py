"""Time of one collective from its kind, payload, group size and the interconnect (per device, seconds).

Conventions: `payload` V is the full array the collective acts on within one group (all-gather: the gathered result,
each device holds V/g before; reduce-scatter: the input each device holds before, V/g after; all-reduce: the array;
all-to-all: the operand each device holds, of which (g−1)/g leaves it; collective-permute: the operand sent).
`link_bw` is one-way bytes/s per link, α the per-step latency.

TPU ICI (ring/torus, groups laid along torus axes with wraparound; k = torus axes the group spans, each giving a
bidirectional ring, i.e. 2·k links' worth of one-way bandwidth), after the JAX scaling book ("How to think about
TPUs", collectives chapter):
    all-gather, reduce-scatter : V·(g−1)/g / (2k·link_bw) + α·(g−1)
    all-reduce                 : 2 × reduce-scatter (reduce-scatter then all-gather)
    all-to-all                 : V·g/8 / (k·link_bw)  (average ring distance g/4, both directions)
    collective-permute         : V / link_bw + α;  one of a bidirectional pair (two permutes in flight together,
                                 each the other's pairs reversed: a ring step sending one chunk each way, as libtpu's
                                 collective matmuls do) V / (2·link_bw) + α/2, the pair costing what one does
NVLink (switched, full bisection inside a node; NCCL ring algorithms; per-GPU one-way bandwidth B = link_bw·links):
    all-gather, reduce-scatter : V·(g−1)/g / B + α·(g−1);  all-reduce: 2× that;  all-to-all: V·(g−1)/g / B
    collective-permute         : V / B
    Groups larger than one node (8 GPUs) run at the scale-out (InfiniBand) bandwidth per GPU instead of B.
Infinity Fabric (MI300X: a full mesh, one direct link to each of up to 7 peers):
    all-gather, reduce-scatter, all-to-all : (V/g) / link_bw + α;  all-reduce: 2× that;  permute: V / link_bw
Host memory (simulated CPU devices on one host): a collective is memory traffic through the host's memory:
    all-gather/reduce-scatter/all-to-all move 2·V·(g−1)/g bytes (read + write), all-reduce 4·V·(g−1)/g, permute 2·V,
    at the host's measured streaming bandwidth (the roofline multiplies by the device count: they share it), plus
    α per collective (the host's measured rendezvous cost, per device, at the collective's group size: on a 2-core
    host 8 devices meeting in groups of 2 took 46 µs per collective, all 8 meeting at once 245 µs).
"""
from __future__ import annotations

from workbench.errors import WorkbenchError

GPUS_PER_NODE = 8


def collective_time(kind: str, payload_bytes: float, group_size: int, interconnect, *, torus_axes: int = 1,
                    operands: int = 1, bidirectional: bool = False) -> float:
    """Seconds one device spends in one collective. group_size 1 (or a no-op) costs 0. operands: the arrays a
    combined (tuple) all-reduce carries — one transfer on a real interconnect, but on simulated host devices
    (`host-memory`) XLA:CPU's in-process all-reduce meets once per array, so each pays the rendezvous (8 simulated
    devices here: one all-reduce of 131072 floats 0.89 ms, the same floats as 32 arrays 11.5 ms). An all-to-all's
    operands (one per peer) share one rendezvous: 32 all-to-alls of 8 arrays each ran in 12.4 ms, a rendezvous per
    array would be 62 ms. bidirectional: a collective-permute that is one half of a bidirectional pair
    (CollectiveOp.bidirectional); on a torus the halves use opposite links at once, elsewhere (a switch port's
    egress, host memory) they share one path and each costs its own time."""
    V, g = float(payload_bytes), int(group_size)
    if kind == "collective-permute":
        g = max(g, 2)
    if g <= 1 or V <= 0:
        return 0.0
    kind = kind.replace("ragged-", "")
    ic = interconnect
    a = (ic.latency_for(g) if ic.kind == "host-memory" else ic.latency_s) or 0.0
    frac = (g - 1) / g
    if ic.kind.startswith("ici"):
        k = max(1, torus_axes)
        bw = 2 * k * ic.link_bw
        ag = V * frac / bw + a * (g - 1)
        permute = (V / ic.link_bw + a) / (2 if bidirectional else 1)
        return {"all-gather": ag, "reduce-scatter": ag, "all-reduce": 2 * ag,
                "all-to-all": V * g / 8 / (k * ic.link_bw) + a * (g - 1),
                "collective-broadcast": ag, "collective-permute": permute}[_known(kind)]
    if ic.kind == "nvlink":
        B = ic.link_bw * ic.links
        if g > GPUS_PER_NODE and ic.scale_out_bw:
            B = ic.scale_out_bw
        ag = V * frac / B + a * (g - 1)
        return {"all-gather": ag, "reduce-scatter": ag, "all-reduce": 2 * ag, "all-to-all": V * frac / B + a,
                "collective-broadcast": ag, "collective-permute": V / B + a}[_known(kind)]
    if ic.kind == "infinity-fabric":
        t = (V / g) / ic.link_bw + a
        return {"all-gather": t, "reduce-scatter": t, "all-reduce": 2 * t, "all-to-all": t,
                "collective-broadcast": t, "collective-permute": V / ic.link_bw + a}[_known(kind)]
    if ic.kind == "host-memory":
        traffic = {"all-gather": 2 * V * frac, "reduce-scatter": 2 * V * frac, "all-reduce": 4 * V * frac,
                   "all-to-all": 2 * V * frac, "collective-broadcast": 2 * V * frac,
                   "collective-permute": 2 * V}[_known(kind)]
        meets = max(int(operands), 1) if kind == "all-reduce" else 1
        return traffic / ic.link_bw + a * meets
    raise WorkbenchError(f"no collective model for interconnect kind {ic.kind!r}")


def _known(kind: str) -> str:
    if kind not in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
                    "collective-broadcast"):
        raise WorkbenchError(f"no cost model for collective {kind!r}")
    return kind
