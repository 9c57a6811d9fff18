"""Driver scripts run as processes of their own (a Ray of their own, started as a user's
script would start it), from the repository root, with this checkout's rayflow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "run_driver"]

#: the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_driver(tmp_path: Path, name: str, source: str) -> subprocess.CompletedProcess:
    """Run ``source`` as script ``name`` in a new Python process, with no Ray address in
    its environment (it starts a local Ray, or joins none); output captured."""
    script = tmp_path / name
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True
    )
