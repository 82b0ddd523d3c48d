"""Accelerator workbench: compile a JAX program, read its costs, predict it on a roofline, measure it, record it.

Public API (import from here):
    devices.request_devices  set the simulated CPU device count before JAX starts
    hardware.get_spec        catalogue chip or the calibrated host
    costs.CostReport         per-device costs of one compiled program (frozen, adds)
    compile.compile_program  jit.lower(abstract args).compile() -> Compiled + CostReport
    roofline.predict         HardwareSpec x CostReport -> Prediction
    measure.measure          warm-up, repeats, median/IQR/min, recompile guard
    results.Store            append-only JSON Lines records, loader to pandas
    experiment.run_experiment one call through the whole spine -> Record
"""
__version__ = "0.1.0"
