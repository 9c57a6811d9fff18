"""Benchmarks that ship with rayflow, so ``rayflow bench NAME`` runs them from a wheel.

``rayflow.bench.alignment`` measures what each barrier mode (aligned, unaligned,
with buffer debloating, ...) costs under balanced load and under backpressure.
Benchmarks print measurements; they never assert on timings.
"""

__all__: list[str] = []
