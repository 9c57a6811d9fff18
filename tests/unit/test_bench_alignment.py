"""The alignment benchmark (``rayflow.bench.alignment``): its summary arithmetic without
Ray, and its smallest preset end to end on the shared real Ray."""

from __future__ import annotations

import csv
import math

import pytest

from rayflow import cli
from rayflow.bench import alignment
from rayflow.bench.alignment import Config, Measurement


def _checkpoint(duration_s: float, size: int, channel: int, alignment_s: float | None) -> dict:
    subtask = {"alignment_s": alignment_s, "size": size, "channel_state_size": channel}
    return {
        "duration_s": duration_s,
        "final": False,
        "size": size,
        "channel_state_size": channel,
        "unaligned": channel > 0,
        "subtasks": {"sum#0": subtask, "numbers#0": {**subtask, "alignment_s": None}},
    }


def test_summarize_splits_state_and_compares_with_off():
    off = Config.of("off", "skew", 1.0, 2)
    unaligned = Config.of("unaligned", "skew", 1.0, 2)
    failed = Config.of("aligned", "skew", 1.0, 2)
    rows = alignment.summarize(
        {
            off: [Measurement(off, rate=200.0), Measurement(off, rate=100.0)],
            unaligned: [
                Measurement(
                    unaligned,
                    rate=75.0,
                    checkpoints=[_checkpoint(0.1, 1000, 600, 0.002), _checkpoint(0.3, 500, 0, 0)],
                    latency={"count": 3, "p50_ms": 4.0, "p99_ms": 9.0},
                )
            ],
            failed: [Measurement(failed, error="RuntimeError: boom")],
        }
    )
    by_mode = {r["mode"]: r for r in rows}
    assert off.interval_s == 0.0 and by_mode["off"]["rows_per_s"] == 150.0
    r = by_mode["unaligned"]
    assert r["vs_off"] == 0.5
    assert (r["checkpoints"], r["unaligned_checkpoints"]) == (2, 1)
    assert r["checkpoint_p50_ms"] == 200.0
    assert r["alignment_p50_ms"] == 1.0  # sources (alignment None) left out
    assert r["operator_state_bytes"] == 450.0  # medians of 400 and 500
    assert (r["channel_state_bytes"], r["channel_state_max_bytes"]) == (300.0, 600)
    assert (r["latency_p50_ms"], r["latency_p99_ms"]) == (4.0, 9.0)
    assert by_mode["aligned"]["runs"] == 0 and math.isnan(by_mode["aligned"]["rows_per_s"])
    assert by_mode["aligned"]["error"] == "RuntimeError: boom"


def test_cli_runs_it_as_rayflow_bench_alignment(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "alignment", "--help"])
    assert exc.value.code == 0
    printed = capsys.readouterr().out
    assert "--quick" in printed and "--out DIR" in printed
    args = cli.build_parser().parse_args(["bench", "alignment", "--quick", "--repeat", "3"])
    settings = alignment.settings_from(args)
    assert (settings.preset, settings.repeat, settings.skew_rows) == ("quick", 3, 800_000)


def test_smoke_preset_end_to_end(ray_session, tmp_path, capsys):
    code = alignment.main(["--preset", "smoke", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "[1/2] skew off p=2 ... " in printed and "[2/2] skew unaligned p=2 0.2s ... " in printed

    with open(tmp_path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["workload"]) for r in rows] == [("off", "skew"), ("unaligned", "skew")]
    for r in rows:
        assert r["error"] == "" and float(r["rows_per_s"]) > 0
        assert float(r["latency_p50_ms"]) > 0
    assert int(rows[1]["checkpoints"]) >= 1
    assert float(rows[1]["vs_off"]) > 0

    summary = (tmp_path / "summary.md").read_text()
    assert "| skew unaligned p=2 0.2s | 1 |" in summary
    for png in ("throughput_vs_interval.png", "checkpoint_duration.png", "latency_cdf.png"):
        assert (tmp_path / png).stat().st_size > 0
        assert png in summary
