"""What barrier alignment costs: throughput, checkpoint duration, alignment time,
checkpoint size (operator vs channel state) and end-to-end latency for checkpointing
off, AT_LEAST_ONCE, aligned, aligned + buffer debloating, unaligned and aligned with
a timeout, balanced and under backpressure, over intervals and parallelism.

The benchmark lives in ``rayflow.bench.alignment`` (so ``rayflow bench alignment``
runs it too); this script only calls it. Run from the repository root::

    PYTHONPATH=. python benchmarks/alignment.py [--quick] [--out DIR] [--repeat R]

Writes ``results.csv``, ``summary.md`` (paste into RESULTS.md) and PNG plots into
``--out`` (default ``benchmarks/results/alignment``).
"""

from __future__ import annotations

import sys

from rayflow.bench.alignment import main

if __name__ == "__main__":
    sys.exit(main())
