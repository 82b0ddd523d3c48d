"""The roofline of a predicted step recomputed by hand, for tests/programs (predict and plan): published peaks typed
in from the vendors' pages, the model FLOPs from the analytic counts, each collective priced by the formula
tests/roofline checks by hand."""
import pytest

from models.analytics import analytics
from models.presets import get_config
from partitioning.collectives import collective_time
from workbench.hardware.spec import catalogue_spec as get_spec

# Published headline figures of the target chips (dense bf16 FLOP/s, HBM bytes/s), typed in from the vendors' pages:
# https://cloud.google.com/tpu/docs/v5e ("197 TFLOPs", "819 GBps"), https://cloud.google.com/tpu/docs/v4
# ("275 teraflops", "1200 GBps"), https://www.nvidia.com/en-us/data-center/h100/ ("1,979 teraFLOPS" with sparsity,
# "3.35TB/s"). The prediction's terms are recomputed from the record's own counts with these, by hand.
PUBLISHED = {"tpu-v5e": (197e12, 819e9), "tpu-v4": (275e12, 1200e9), "h100-sxm": (1979e12 / 2, 3.35e12)}


def hand_model_flops(preset, mode, batch, seq):
    """Model FLOPs of one step, from the analytic counts (themselves checked against 6N + 12·L·d·s by hand in
    tests/models/test_transformer.py): train 3 × forward per token; prefill skips the output head on all but the
    last position; decode is one token per sequence."""
    cfg = get_config(preset)
    a = analytics(cfg, seq)
    if mode == "train":
        return a["train_flops_per_token"] * batch * seq
    if mode == "prefill":
        return a["forward_flops_per_token"] * batch * seq - 2 * cfg.vocab_size * cfg.d_model * batch * (seq - 1)
    return a["forward_flops_per_token"] * batch


def check_terms(r: dict, collectives: list[dict]) -> float:
    """Every term of a prediction (`r`: the body `workbench.programs.predict` returns or stores as `extra`;
    `collectives`: the stored record's costs.collectives) against hand arithmetic from the record's own flops, bytes
    and collectives and the published peaks (not against the code's max(pred, floor), which cannot fail).
    Returns the predicted step so derived by hand."""
    bf16, hbm_bw = PUBLISHED[r["chip"]]
    hw = get_spec(r["chip"])
    assert r["compute_dtype"] == "bfloat16"  # the bf16 policy: priced at the published bf16 peak
    floor = hand_model_flops(r["preset"], r["mode"], r["batch"], r["seq"]) / (r["n_chips"] * bf16)
    assert r["analytic_floor_s"] == pytest.approx(floor, rel=1e-9)
    trans_s = r["transcendentals_per_device"] / hw.transcendentals_per_s if hw.transcendentals_per_s else 0.0
    assert r["compute_s"] == pytest.approx(r["flops_per_device"] / bf16 + trans_s, rel=1e-9)
    assert r["memory_s"] == pytest.approx(r["bytes_per_device"] / hbm_bw, rel=1e-9)
    # communication: each collective the stored record lists (kind, payload, group size, runs) priced by the formula
    # tests/roofline/test_prediction.py checks by hand; their payloads add up to the per-kind totals of the answer
    colls = collectives
    by_kind = {}
    for c in colls:
        by_kind[c["kind"]] = by_kind.get(c["kind"], 0.0) + c["payload_bytes"] * c["count"]
    assert by_kind == pytest.approx({k: v["bytes"] for k, v in r["collectives_by_kind"].items()})
    # each at the torus dimensions its own groups span (the program's figure where its groups were not kept)
    comm = sum(c["count"] * collective_time(c["kind"], c["payload_bytes"], c["group_size"], hw.interconnect,
                                            torus_axes=c.get("torus_axes") or r["torus_axes"] or 1,
                                            bidirectional=bool(c.get("bidirectional"))) for c in colls)
    assert r["comm_s"] == pytest.approx(comm, rel=1e-9)
    # the headline: the kernels' roofline overlapped with communication, never below the analytic floor
    step = max(r["kernel_s"], comm, floor)
    assert r["predicted_step_s"] == pytest.approx(step, rel=1e-9)
    assert r["predicted_mfu"] == pytest.approx(floor / step, rel=1e-9)
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / step, rel=1e-9)
    # kernel by kernel the program cannot beat its own compute at the peak: the HLO kernels' flops account for the
    # compiler's count within 10 % (otherwise the program-level max(compute_s, memory_s) is used)
    assert r["kernel_s"] >= 0.9 * r["flops_per_device"] / bf16
    return step
