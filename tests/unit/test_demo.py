"""``rayflow demo`` without Ray: counting by order id, what breaks a guarantee, the table,
the exit status, the seeded kills, the running-total step and the errors for a target
that cannot be used."""

from __future__ import annotations

import argparse

import numpy as np
import pyarrow as pa
import pytest

import rayflow.demo as demo
from rayflow.demo.report import format_table, format_verdicts, plot_runs
from rayflow.demo.runs import DemoSettings, Guarantee, RunReport, count_orders
from rayflow.demo.targets import SinkKind, _safe_dsn
from rayflow.jobs import orders
from rayflow.testing import FaultPoint


def report(guarantee, ids, expected=10, failed=None, samples=None, restarts=1):
    return RunReport(
        guarantee=guarantee,
        count=count_orders(np.asarray(ids), expected),
        seconds=2.0,
        kills_planned=2,
        restarts=restarts,
        failed=failed,
        checkpoints_completed=0 if guarantee is Guarantee.NONE else 4,
        mean_checkpoint_s=None if guarantee is Guarantee.NONE else 0.0421,
        samples=samples or [],
    )


def test_count_orders_by_order_id():
    c = count_orders(np.array([0, 1, 1, 1, 3, 4, 4, 99, -1]), 5)
    assert (c.expected, c.committed) == (5, 9)
    assert c.lost == 1  # order 2
    assert c.duplicated == 3  # 1 twice more, 4 once more
    assert c.unexpected == 2  # 99 and -1 are no orders of the input
    empty = count_orders(np.zeros(0, dtype=np.int64), 3)
    assert (empty.committed, empty.lost, empty.duplicated) == (0, 3, 0)


def test_what_breaks_each_guarantee():
    exact = list(range(10))
    assert report(Guarantee.EXACTLY_ONCE, exact).broken() is None
    assert "1 lost" in report(Guarantee.EXACTLY_ONCE, exact[1:]).broken()
    assert "1 duplicated" in report(Guarantee.EXACTLY_ONCE, exact + [3]).broken()
    assert "failed" in report(Guarantee.EXACTLY_ONCE, exact, failed="died").broken()
    shrinking = report(Guarantee.EXACTLY_ONCE, exact, samples=[(0, 0), (1, 6), (2, 4), (3, 10)])
    assert "vanished" in shrinking.broken()

    assert report(Guarantee.AT_LEAST_ONCE, exact + [1, 2]).broken() is None
    assert "1 lost" in report(Guarantee.AT_LEAST_ONCE, exact[1:]).broken()
    # at least once may rewrite a part with less in it for a while
    dipping = report(Guarantee.AT_LEAST_ONCE, exact, samples=[(0, 6), (1, 4), (2, 10)])
    assert dipping.broken() is None and dipping.largest_dip == 2

    assert report(Guarantee.NONE, [0, 1, 2], failed="died", restarts=0).broken() is None
    assert "duplicated" in report(Guarantee.NONE, [0, 0]).broken()
    assert "no order" in report(Guarantee.AT_LEAST_ONCE, exact + [10]).broken()


def test_table_has_one_aligned_row_per_run():
    reports = [
        report(Guarantee.NONE, [0, 1, 2], failed="died", restarts=0),
        report(Guarantee.AT_LEAST_ONCE, list(range(10)) + [4, 5]),
        report(Guarantee.EXACTLY_ONCE, list(range(10))),
    ]
    lines = format_table(reports).splitlines()
    assert lines[0].split()[:5] == ["guarantee", "expected", "committed", "lost", "duplicated"]
    assert len(lines[1]) == max(len(line) for line in lines)  # the rule spans every row
    # numbers are right-aligned: each row's "duplicated" cell ends where its header does
    end = lines[0].index("duplicated") + len("duplicated")
    assert all(line[end - 1] != " " and line[end] == " " for line in lines[2:])
    none, alo, eo = lines[2:]
    assert none.startswith("NONE (checkpoints off)") and none.endswith("1 of 2, job failed")
    assert none.split()[3:7] == ["10", "3", "7", "0"]
    assert alo.split()[1:5] == ["10", "12", "0", "2"]
    assert "42 ms" in alo and eo.endswith("1 of 2")  # one restart: one kill fired
    assert "5 rec/s" in eo  # 10 distinct orders in 2 s
    verdicts = format_verdicts(reports)
    assert "7 orders lost" in verdicts and "2 repeated orders" in verdicts
    assert "exactly once" in verdicts and "BROKEN" not in verdicts


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    reports = [
        report(Guarantee.NONE, [0, 1], failed="died", samples=[(0, 0), (1, 2)], restarts=0),
        report(Guarantee.EXACTLY_ONCE, list(range(10)), samples=[(0, 0), (1, 5), (2, 10)]),
    ]
    out = tmp_path / "runs.png"
    plot_runs(reports, str(out), "demo")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def args_for(tmp_path, **overrides):
    parser = demo.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--sink", "files", "--records", "10", "--failures", "2"])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize(
    "eo_ids, alo_ids, code",
    [
        (list(range(10)), list(range(10)) + [1], 0),
        (list(range(10)) + [7], list(range(10)), 1),  # EXACTLY_ONCE duplicated an order
        (list(range(9)), list(range(10)), 1),  # EXACTLY_ONCE lost one
        (list(range(10)), list(range(9)), 1),  # AT_LEAST_ONCE lost one
    ],
)
def test_exit_status_says_whether_every_guarantee_held(
    monkeypatch, tmp_path, capsys, eo_ids, alo_ids, code
):
    ids = {Guarantee.NONE: [0, 1], Guarantee.AT_LEAST_ONCE: alo_ids, Guarantee.EXACTLY_ONCE: eo_ids}

    def fake_run(target, guarantee, settings):
        failed = "died" if guarantee is Guarantee.NONE else None
        return report(guarantee, ids[guarantee], settings.records, failed=failed)

    monkeypatch.setattr(demo, "run_guarantee", fake_run)
    monkeypatch.setattr(demo, "ensure_ray", lambda *a, **k: None)
    assert demo.run(args_for(tmp_path)) == code
    out = capsys.readouterr().out
    assert ("GUARANTEE BROKEN" in out) == bool(code)


def test_postgres_needs_a_dsn(capsys):
    assert demo.run(args_for(None, sink=SinkKind.POSTGRES, dsn=None)) == 2
    assert "--sink postgres needs --dsn" in capsys.readouterr().err


def test_a_dsn_is_described_without_user_or_password():
    pytest.importorskip("psycopg")
    text = _safe_dsn("postgresql://demo:s3cret-pw@db.example:5433/orders")
    assert text == "db.example:5433/orders"
    assert _safe_dsn("host=h password=s3cret-pw dbname=d") == "h:5432/d"
    assert "s3cret" not in _safe_dsn("not a dsn password=s3cret")


def test_every_run_gets_the_same_seeded_kills_and_each_fires_in_a_restart():
    settings = DemoSettings(records=200_000, failures=3, seed=5, parallelism=2)
    plan = settings.fault_plan()
    assert plan.faults == DemoSettings(records=200_000, failures=3, seed=5).fault_plan().faults
    assert plan.faults != DemoSettings(records=200_000, failures=3, seed=6).fault_plan().faults
    assert [f.attempt for f in plan.faults] == [0, 1, 2]
    assert all(f.point is FaultPoint.AFTER_RECORDS and f.action == "sigkill" for f in plan.faults)
    assert all(f.vertex == "RunningTotal" and f.subtask in (0, 1) for f in plan.faults)
    # each threshold lies within a quarter of 80% of a subtask's share (3 kills + the rest),
    # so all of them together stay below what one subtask takes
    share = 200_000 // 2 * 0.8
    assert all(share / 8 <= f.records <= share / 4 for f in plan.faults)
    assert sum(f.records for f in plan.faults) < share
    assert DemoSettings(records=10, failures=0, seed=1).fault_plan().faults == []


def test_running_total_adds_up_per_customer():
    values = pa.record_batch([pa.array(np.arange(0, 500))], ["value"])
    batch = orders.start_running_total(orders.generate_orders(values, 7))
    totals: dict[int, dict] = {}
    for record in batch.to_pylist():
        record = orders.enrich(record)
        key = record["customer_id"]
        out = record if key not in totals else orders.add_running_total(totals[key], record)
        totals[key] = out
        assert list(out) == list(orders.ORDER_STREAM_COLUMNS)
    ids, expected = orders.expected_totals(500, 7)
    got = {k: v["customer_total_cents"] for k, v in totals.items()}
    assert got == dict(zip(ids.tolist(), expected.tolist(), strict=True))
