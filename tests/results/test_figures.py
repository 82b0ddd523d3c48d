"""The roofline chart's legend: a physical roof never reads as the machine's when XLA measured more."""
import os

from workbench.programs.replay import HOSTS_DIR, stored_spec
from workbench.results.figures import physical_label


def test_a_physical_roof_under_the_measured_one_names_the_clock_the_measurement_implies():
    spec = stored_spec(os.path.join(HOSTS_DIR, "zen5-2026-12-04"))  # OS clock 2.60 GHz; XLA measured above it
    phys = spec.measured.physical_peak_flops["float32"]
    assert spec.peak_flops["float32"] > phys
    label = physical_label(spec, "float32", phys)
    implied = spec.measured.physical_clock_ghz * spec.peak_flops["float32"] / phys
    assert "physical at 2.60 GHz" in label and f"implies ≥ {implied:.2f} GHz" in label


def test_a_physical_roof_above_the_measured_one_names_its_clock_only():
    spec = stored_spec(os.path.join(HOSTS_DIR, "xeon-amx-2026-12-05"))
    phys = spec.measured.physical_peak_flops["float32"]
    assert spec.peak_flops["float32"] <= phys
    assert physical_label(spec, "float32", phys) == "float32 (physical at 2.60 GHz)"
