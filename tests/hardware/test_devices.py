"""Where programs run: the platform chosen before JAX starts, the device-kind map, the device calibration's form."""
import os
import subprocess
import sys

import pytest

from workbench.errors import WorkbenchError
from workbench.hardware import devices
from workbench.hardware.spec import catalogue, resolve_name
from workbench.measure.device import calibrate_device, calibrated_spec, chip_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the device kinds JAX reports (jax/_src/tpu_info.py for TPUs; the driver's device name for GPUs)
KINDS = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA A100-SXM4-80GB": "a100-80gb",
         "NVIDIA B200": "b200", "TPU v4": "tpu-v4", "TPU v5 lite": "tpu-v5e", "TPU v5": "tpu-v5p",
         "TPU v6 lite": "tpu-v6e", "TPU7x": "tpu-v7x", "AMD Instinct MI300X": "mi300x"}


@pytest.mark.parametrize("kind,chip", sorted(KINDS.items()))
def test_every_device_kind_jax_reports_resolves_to_its_catalogue_entry(kind, chip):
    assert chip in catalogue(), chip
    assert resolve_name(kind) == chip
    assert chip_for(kind, warn=False).name == chip


def test_an_unknown_device_kind_warns_once_naming_the_option(capsys):
    assert chip_for("NVIDIA H100 PCIe") is None  # another part than the SXM entry: no silent match
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hardware CHIP" in err and "NVIDIA H100 PCIe" in err


def _choose(code: str, env: dict) -> subprocess.CompletedProcess:
    """select_platform in a fresh process (the platform is fixed once JAX starts)."""
    full = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | env
    return subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_a_cpu_host_runs_on_the_cpu_quietly_and_records_it():
    r = _choose("from workbench.hardware.devices import select_platform, device_info; "
                "p = select_platform('auto'); print(p, device_info()['platform'])", {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu", "cpu"]
    assert "workbench: platform" not in r.stderr  # bad input still reads as one line on a CPU host


def test_an_accelerator_chosen_is_said_on_stderr(monkeypatch, capsys):
    """What select_platform says when it sends programs to a GPU (the JAX platform itself is not switched here:
    this process already runs on the CPU)."""
    monkeypatch.setattr(devices, "_backends_started", lambda: False)
    monkeypatch.setattr(devices, "detect_accelerator", lambda: ("gpu", "an NVIDIA GPU and the JAX CUDA plugin"))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(devices, "_chosen", {})
    import jax

    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    assert devices.select_platform("auto") == "gpu"
    err = capsys.readouterr().err
    assert err.startswith("workbench: platform gpu (an NVIDIA GPU and the JAX CUDA plugin") and "--platform cpu" in err


def test_jax_platforms_wins_and_devices_imply_the_cpu():
    r = _choose("from workbench.hardware.devices import request_devices; import jax; "
                "print(request_devices(4), jax.devices()[0].platform)", {"JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4", "cpu"]


def test_bad_platform_choices_are_one_line_errors():
    with pytest.raises(WorkbenchError, match="unknown --platform 'npu'"):
        devices.select_platform("npu")
    with pytest.raises(WorkbenchError, match="--devices simulates CPU devices"):
        devices.select_platform("gpu", simulated_devices=8)


def test_accelerator_detection_needs_the_device_and_its_plugin(monkeypatch, tmp_path):
    """A GPU on the PCI bus without the JAX CUDA plugin is not chosen (JAX could not drive it); with the plugin it
    is; a host with neither is a CPU host."""
    import glob as globmod
    import importlib.util

    real_glob, real_find = globmod.glob, importlib.util.find_spec
    pci = tmp_path / "0000:01:00.0"
    pci.mkdir()
    (pci / "vendor").write_text("0x10de\n")
    (pci / "class").write_text("0x030200\n")
    monkeypatch.setattr(globmod, "glob", lambda p: [str(pci / "vendor")] if p.startswith("/sys/bus/pci") else
                        ([] if p.startswith("/dev/") else real_glob(p)))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n.startswith("jax_plugins") else real_find(n, *a))
    kind, why = devices.detect_accelerator()
    assert kind is None and "no JAX CUDA plugin" in why
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: object() if n.startswith("jax_plugins") else real_find(n, *a))
    assert devices.detect_accelerator()[0] == "gpu"
    (pci / "vendor").write_text("0x8086\n")
    assert devices.detect_accelerator() == (None, "no GPU or TPU on this host")


def test_the_device_calibration_lays_its_ceilings_over_the_catalogue_chip():
    """calibrate_device's figures (here the CPU's, at the quick sizes) become the calibrated spec's: the measured
    matmul per dtype, the bf16 rate against size, the stream and the per-kernel launch cost; the catalogue chip's
    other figures stay."""
    cal = calibrate_device(quick=True, quiet=True)
    assert set(cal["matmul"]) >= {"bfloat16", "float32"}
    assert cal["stream"]["bytes_per_s"] > 0 and cal["kernel_launch"]["per_kernel_s"] >= 0
    chip = chip_for("NVIDIA H200")
    s = calibrated_spec(chip, cal)
    assert s.name == "h200-calibrated" and s.hbm_bytes == chip.hbm_bytes
    assert s.peak("bfloat16") == cal["matmul"]["bfloat16"]["flops_per_s"]
    assert s.hbm_bw == cal["stream"]["bytes_per_s"]
    small, big = cal["matmul_curve_bfloat16"][0], cal["matmul_curve_bfloat16"][-1]
    assert s.matmul_rate(small[0], "bfloat16") <= s.matmul_rate(big[0], "bfloat16")


def test_an_all_reduce_over_the_devices_becomes_the_calibrated_interconnect():
    """Several devices: the all-reduce's bus bandwidth (2(n-1)/n x bytes per device / time) spread over the chip's
    links, and its per-ring-step latency, replace the catalogue's interconnect figures (here on the 8 simulated CPU
    devices, at the quick size: the mechanics, not a CPU's links)."""
    import jax

    from workbench.measure.device import _all_reduce

    ar = _all_reduce(jax.devices(), quick=True)
    n = len(jax.devices())
    assert ar["devices"] == n and ar["large"]["seconds"] > 0 and ar["small"]["seconds"] > 0
    assert ar["bus_bytes_per_s"] == pytest.approx(2 * (n - 1) / n * ar["large"]["bytes_per_device"]
                                                  / ar["large"]["seconds"])
    chip = chip_for("NVIDIA H100 80GB HBM3")
    s = calibrated_spec(chip, {"key": {"device_kind": "NVIDIA H100 80GB HBM3"}, "matmul": {},
                               "stream": {"bytes_per_s": 3e12}, "all_reduce": ar})
    assert s.interconnect.per_chip_bw == pytest.approx(ar["bus_bytes_per_s"])
    assert s.interconnect.latency_s == ar["latency_per_step_s"] and s.interconnect.kind == chip.interconnect.kind
