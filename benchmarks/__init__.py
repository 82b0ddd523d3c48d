"""Benchmarks, studies and the GPU device-check script (run as modules: python -m benchmarks.<name>)."""
