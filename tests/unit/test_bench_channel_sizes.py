"""benchmarks/channel_sizes.py: its variants."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from channel_sizes import parse_variant  # noqa: E402


def test_a_variant_is_message_and_channel_mib_or_auto():
    assert parse_variant("4/16") == (4 << 20, 16 << 20)
    assert parse_variant("auto") is None
    for bad in ("4", "4/x", "0/16", "4/16/1"):
        with pytest.raises(argparse.ArgumentTypeError, match="variant|sizes"):
            parse_variant(bad)
