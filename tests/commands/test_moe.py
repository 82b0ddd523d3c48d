"""`workbench moe route` and `workbench moe layer` (in-process; 8 simulated devices from conftest)."""
import json
import math

import pytest

from partitioning.collectives import collective_time
from workbench.cli import main
from workbench.hardware.spec import catalogue_spec as get_spec


def _run(capsys, *args):
    main(list(args))
    return json.loads(capsys.readouterr().out)


def test_route_counts_and_capacity(capsys):
    base = ["moe", "route", "--tokens", "1024", "--experts", "8", "--top-k", "2", "--router", "token-choice",
            "--skew", "0.5", "--json"]
    tight = _run(capsys, *base, "--capacity-factor", "1.0")
    loose = _run(capsys, *base, "--capacity-factor", "8.0")
    for out in (tight, loose):
        assert out["dispatched"] + out["dropped"] == 1024 * 2
        assert sum(out["load_per_expert"]) == 1024 * 2
        assert out["dropped_fraction"] == pytest.approx(out["dropped"] / 2048)
    assert tight["capacity_per_expert"] == 256
    # with skew the busiest expert wants more than its 256 slots: exactly the excess is dropped
    excess = sum(max(0.0, load - 256) for load in tight["load_per_expert"])
    assert tight["dropped"] >= excess > 0
    assert loose["dropped_fraction"] == 0
    # expert-choice: every expert takes C tokens; dropped = tokens nobody took
    ec = _run(capsys, "moe", "route", "--tokens", "256", "--experts", "4", "--top-k", "1", "--capacity-factor",
              "1.0", "--router", "expert-choice", "--json")
    assert ec["load_max_over_mean"] == pytest.approx(1.0)
    assert 0 <= ec["dropped_fraction"] < 1


def test_route_per_device_groups_drop_at_least_as_much(capsys):
    base = ["moe", "route", "--tokens", "1024", "--experts", "8", "--top-k", "2", "--capacity-factor", "1.0",
            "--skew", "0.3", "--json"]
    one = _run(capsys, *base)
    eight = _run(capsys, *base, "--ep", "8")
    assert eight["capacity_per_expert"] == math.ceil(1.0 * 128 * 2 / 8)
    assert eight["load_per_expert"] == one["load_per_expert"]  # same choices, different capacity groups
    assert eight["dropped"] >= one["dropped"]


@pytest.mark.parametrize("args,msg", [
    (["--experts", "4", "--top-k", "9", "--capacity-factor", "1"], "top-k"),
    (["--experts", "4", "--top-k", "0"], "top-k"),
    (["--capacity-factor", "0"], "capacity factor"),
    (["--capacity-factor", "-2"], "capacity factor"),
    (["--router", "hash"], "unknown router"),
    (["--experts", "6", "--top-k", "2", "--ep", "4"], "not divisible by the expert axis"),
    (["--tokens", "0"], "--tokens"),
])
def test_route_bad_input_is_one_line_exit_2(capsys, args, msg):
    with pytest.raises(SystemExit) as e:
        main(["moe", "route", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


@pytest.mark.compile_heavy
def test_layer_costs_match_the_layout(capsys, results_dir):
    T, D, F, E, K, cf = 512, 16, 32, 8, 2, 1.25
    out = _run(capsys, "moe", "layer", "--tokens", str(T), "--seq", "16", "--d-model", str(D), "--d-ff", str(F),
               "--experts", str(E), "--top-k", str(K), "--capacity-factor", str(cf), "--mesh", "expert=8",
               "--json")
    C = math.ceil(cf * (T // 8) * K / E)  # one routing group per device
    # dispatch and combine each move the device's whole (E, C, D) float32 buffer through one all-to-all
    assert out["all_to_all_count"] == 2
    assert out["all_to_all_bytes_per_device"] == 2 * E * C * D * 4
    # the experts' compiled flops are the padded buffer's: useful / compiled = (T·k/8) / (E·C) per device
    assert out["expert_flops_efficiency"] == pytest.approx((T * K / 8) / (E * C), rel=0.1)
    assert 0 < out["flops_routing_dispatch_per_device"] < out["flops_experts_per_device"]
    assert set(out["predictions"]) == {"tpu-v5e", "h100-sxm"}
    for chip, p in out["predictions"].items():
        # two all-to-alls of one (E, C, D) float32 buffer over the 8-way expert group, each priced by the formula
        # tests/roofline/test_prediction.py checks by hand, on the chip's interconnect
        a2a = collective_time("all-to-all", E * C * D * 4, 8, get_spec(chip).interconnect)
        assert p["comm_by_kind_s"]["all-to-all"] == pytest.approx(2 * a2a, rel=1e-9)
        assert p["comm_s"] == pytest.approx(sum(p["comm_by_kind_s"].values()), rel=1e-12)
        assert p["predicted_s"] >= p["comm_s"]  # perfect overlap: max(kernels, communication)
    # the layer's flops at Google's published v5e bf16 peak (https://cloud.google.com/tpu/docs/v5e: 197 TFLOPs;
    # the catalogue publishes no v5e special-function rate, so no transcendental term)
    assert out["predictions"]["tpu-v5e"]["compute_s"] == pytest.approx(out["flops_total_per_device"] / 197e12,
                                                                       rel=1e-9)
    assert 0 <= out["dropped_fraction"] <= 1
    rec = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    assert rec[-1]["kind"] == "moe_layer" and rec[-1]["extra"]["all_to_all_bytes_per_device"] == \
        out["all_to_all_bytes_per_device"]


@pytest.mark.compile_heavy
def test_layer_under_dp_routes_per_device_without_replicating_experts(capsys, results_dir):
    T, D, F, E, K, cf = 512, 16, 32, 4, 2, 1.25
    out = _run(capsys, "moe", "layer", "--tokens", str(T), "--seq", "16", "--d-model", str(D), "--d-ff", str(F),
               "--experts", str(E), "--top-k", str(K), "--capacity-factor", str(cf), "--mesh", "data=8",
               "--strategy", "dp", "--no-record", "--json")
    assert out["all_to_all_count"] == 0
    C = math.ceil(cf * (T // 8) * K / E)
    # each device runs its own (E, C) buffer: no device repeats another's expert rows
    assert out["expert_flops_efficiency"] == pytest.approx((T * K / 8) / (E * C), rel=0.1)


@pytest.mark.compile_heavy
def test_layer_dropless_on_data8_does_grouped_matmul_work_within_1_3x_of_useful(capsys, results_dir):
    """Issue 19: `moe layer --mesh data=8` counts the grouped matmul's flops (the blocked form on XLA:CPU, trip counts
    included) within 1.3x of the useful 2·T·k·D·F·3 / devices, dropless and with capacity 1.25."""
    for extra in (["--dropless"], ["--capacity-factor", "1.25"]):
        out = _run(capsys, "moe", "layer", "--tokens", "2048", "--seq", "16", "--d-model", "32", "--d-ff", "64",
                   "--experts", "4", "--top-k", "2", "--mesh", "data=8", "--strategy", "dp", "--no-record", "--json",
                   *extra)
        assert 1.0 <= out["expert_flops_over_useful"] <= 1.3, (extra, out["expert_flops_over_useful"])
    assert out["grouped_matmul"] == "dense (E, C) einsum"


def test_gmm_command_on_cpu_picks_the_blocked_form(capsys, results_dir):
    out = _run(capsys, "moe", "gmm", "--rows", "512", "--d-model", "32", "--d-ff", "64", "--experts", "4",
               "--targets", "cpu", "--policy", "float32", "--json")
    cpu = out["backends"]["cpu"]
    assert cpu["forms"]["gmm"]["compiled"] is False
    assert cpu["forms"]["blocked"]["flops_over_useful"] <= 1.3
    assert cpu["forms"]["ragged_dot"]["flops_over_useful"] > 2  # XLA:CPU: dense over every expert
    assert cpu["best"] == cpu["auto"] == "blocked"
