"""Accelerator workbench: compile a JAX program, read its costs, predict it on a roofline, measure it, record it.

Floors, lowest first (each imports only those below it; docs/ARCHITECTURE.md):
    workbench.cost       compile_program, CostReport, the HLO reader, analytic counts
    workbench.hardware   HardwareSpec and the catalogue, simulated devices, the host allocator
    models, partitioning the model family; meshes, rules and Strategy objects, TPU/GPU targets
    workbench.roofline   predict(CostReport, HardwareSpec) -> Prediction
    workbench.measure    the one timing harness, per-kernel profiles, host calibration (get_spec('host'))
    workbench.results    the results store, figures, console output
    workbench.programs   train, predict, plan, experiment, the studies: typed results with to_record()
    workbench.commands   the CLI (`workbench --help`)
"""
__version__ = "0.1.0"
