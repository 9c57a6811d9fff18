"""The ``rayflow`` command and the orders job's verification; no Ray needed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import rayflow
from rayflow import cli
from rayflow.jobs import orders

# A job script that records how it was run, without touching Ray.
_RECORDING_JOB = textwrap.dedent(
    """
    import json, os, sys
    import helper_module  # a sibling of the script: its directory must be on sys.path
    out = sys.argv[1]
    with open(out, "w") as f:
        json.dump({
            "name": __name__,
            "argv": sys.argv,
            "ray_address": os.environ.get("RAY_ADDRESS"),
            "helper": helper_module.VALUE,
        }, f)
    """
)


@pytest.fixture
def job(tmp_path, monkeypatch):
    """Path of the recording job script and the file it writes."""
    # removed now, and after the test as it was before (``rayflow run --address`` sets it)
    monkeypatch.setenv("RAY_ADDRESS", "")
    monkeypatch.delenv("RAY_ADDRESS")
    script = tmp_path / "job.py"
    script.write_text(_RECORDING_JOB)
    (tmp_path / "helper_module.py").write_text("VALUE = 42\n")
    monkeypatch.delitem(sys.modules, "helper_module", raising=False)
    return str(script), str(tmp_path / "out.json")


def _read(out: str) -> dict:
    with open(out) as f:
        return json.load(f)


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"rayflow {rayflow.__version__}"


def test_help_lists_commands_and_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for word in ("run", "demo", "--version", "examples:", "rayflow demo"):
        assert word in text


def test_demo_help_shows_its_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = capsys.readouterr().out
    for option in (
        "--sink",
        "--dsn",
        "--records",
        "--failures",
        "--seed",
        "--plot",
        "--parallelism",
        "--address",
    ):
        assert option in text
    for sink in ("s3", "files", "postgres"):
        assert sink in text


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: rayflow" in capsys.readouterr().err


def test_run_missing_file_exits_2(tmp_path, capsys):
    missing = str(tmp_path / "no_such_job.py")
    assert cli.main(["run", missing]) == 2
    err = capsys.readouterr().err
    assert "no such job file" in err and "no_such_job.py" in err


def test_run_missing_file_from_console_script():
    proc = subprocess.run(
        [sys.executable, "-m", "rayflow.cli", "run", "definitely/not/here.py"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no such job file" in proc.stderr


def test_run_passes_args_as_main(job):
    script, out = job
    argv_before, path_before = list(sys.argv), list(sys.path)
    assert cli.main(["run", script, out, "--orders", "5", "x"]) == 0
    seen = _read(out)
    assert seen["name"] == "__main__"
    assert seen["argv"] == [script, out, "--orders", "5", "x"]
    assert seen["ray_address"] is None
    assert seen["helper"] == 42
    assert sys.argv == argv_before and sys.path == path_before  # restored


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--address", "10.0.0.1:6379", "{script}", "{out}", "-v"],
        ["run", "{script}", "--address", "10.0.0.1:6379", "{out}", "-v"],
        ["run", "{script}", "--address=10.0.0.1:6379", "{out}", "-v"],
    ],
)
def test_run_address_sets_ray_address_and_is_not_passed_on(job, argv, monkeypatch):
    monkeypatch.setattr("rayflow.ray_connect.check_address", lambda address: None)  # no cluster
    script, out = job
    assert cli.main([a.format(script=script, out=out) for a in argv]) == 0
    seen = _read(out)
    assert seen["ray_address"] == "10.0.0.1:6379"
    assert seen["argv"] == [script, out, "-v"]


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--detach", "--address", "10.0.0.1:6379", "{script}", "{out}", "-v"],
        ["run", "{script}", "--detach", "--address", "10.0.0.1:6379", "{out}", "-v"],
    ],
)
def test_run_detach_is_taken_off_the_jobs_args(job, argv, monkeypatch, capsys):
    """A script that never calls execute() under --detach: an error naming that."""
    monkeypatch.setattr("rayflow.ray_connect.check_address", lambda address: None)  # no cluster
    script, out = job
    assert cli.main([a.format(script=script, out=out) for a in argv]) == 2
    assert "ended without starting a job" in capsys.readouterr().err
    assert _read(out)["argv"] == [script, out, "-v"]
    from rayflow import detached

    assert not detached.is_requested()  # only for that run


def test_run_detach_needs_a_cluster(job, capsys):
    script, out = job
    assert cli.main(["run", "--detach", script, out]) == 2
    assert "--detach needs a running Ray cluster" in capsys.readouterr().err


def test_jobs_commands_need_a_cluster(monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["jobs", "status", "x"]) == 2
    assert "--address" in capsys.readouterr().err


def test_jobs_tables_read_as_a_user_expects():
    from rayflow.jobs_cli import describe_checkpoints, describe_list, describe_status

    status = {
        "name": "orders",
        "job_id": "abc",
        "run_id": "run-1",
        "state": "RUNNING",
        "submitted_at": 1.0,
        "started_at": 2.0,
        "finished_at": None,
        "attempt": 1,
        "restarts": 1,
        "failure": "subtask 1/2 of 'Sum' died",
        "error": None,
        "last_checkpoint": {"checkpoint_id": 7, "trigger_time": 3.0},
        "records": {"numbers -> Map": {"records_in": 0, "records_out": 12000}},
    }
    listing = describe_list([status]).splitlines()
    assert listing[0].split() == [
        "NAME",
        "STATE",
        "RUN",
        "SUBMITTED",
        "RESTARTS",
        "LAST",
        "CHECKPOINT",
    ]
    assert listing[1].startswith("orders  RUNNING  run-1")
    text = describe_status(status)
    assert "job 'orders': RUNNING" in text and "12,000 out" in text and "last failure" in text
    table = describe_checkpoints(
        [{"checkpoint_id": 7, "status": "COMPLETED", "duration_s": 0.25, "size": 2048}]
    )
    assert "7" in table and "COMPLETED" in table and "250 ms" in table and "2,048 B" in table
    assert describe_list([]) == "no detached jobs"


def test_run_double_dash_passes_everything_to_job(job):
    script, out = job
    assert cli.main(["run", script, "--", out, "--address", "a:1"]) == 0
    seen = _read(out)
    assert seen["ray_address"] is None
    assert seen["argv"] == [script, out, "--address", "a:1"]


def test_run_propagates_job_exit_code(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", str(script)])
    assert exc.value.code == 3


def test_checkpoints_of_a_missing_path_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["checkpoints", str(tmp_path / "nothing")]) == 2
    assert "nothing: no such directory" in capsys.readouterr().err


# --- the orders job's data and verification (no Ray: the pipeline is replayed in numpy) ---


def _simulate_job(n: int, customers: int, batch_size: int) -> pa.Table:
    """What the job emits, computed locally: one running total per key per batch."""
    rows: dict[str, list[int]] = {"customer_id": [], "amount_cents": []}
    running: dict[int, int] = {}
    for lo in range(0, n, batch_size):
        values = pa.record_batch([pa.array(np.arange(lo, min(n, lo + batch_size)))], ["value"])
        batch = orders.generate_orders(values, customers)
        enriched = [orders.enrich(r) for r in batch.to_pylist()]
        touched: dict[int, None] = {}
        for r in enriched:
            running[r["customer_id"]] = running.get(r["customer_id"], 0) + r["amount_cents"]
            touched[r["customer_id"]] = None
        for key in touched:
            rows["customer_id"].append(key)
            rows["amount_cents"].append(running[key])
    return pa.table(rows)


def test_generated_orders_are_deterministic_and_in_range():
    values = pa.record_batch([pa.array(np.arange(1000, 3000))], ["value"])
    a = orders.generate_orders(values, 50)
    b = orders.generate_orders(values, 50)
    assert a.equals(b)
    assert a.schema.names == ["order_id", "customer_id", "product", "amount_cents"]
    assert set(a.column("customer_id").to_pylist()) <= set(range(50))
    cents = np.asarray(a.column("amount_cents"))
    assert cents.min() >= 100 and cents.max() <= 49_999
    assert set(a.column("product").to_pylist()) <= set(orders.PRODUCTS)
    record = orders.enrich(a.slice(0, 1).to_pylist()[0])
    assert record["region"] in orders.REGIONS
    assert record["amount_usd"] == record["amount_cents"] / 100


def test_verify_totals_accepts_correct_output_and_rejects_wrong_output():
    table = _simulate_job(5000, 37, batch_size=700)
    assert orders.verify_totals(table, 5000, 37).ok

    # one order duplicated (at-least-once replay): that customer's total is too high
    ids, totals = orders.final_totals(table)
    bad = pa.table({"customer_id": [int(ids[0])], "amount_cents": [int(totals[0]) + 123]})
    check = orders.verify_totals(pa.concat_tables([table, bad]), 5000, 37)
    assert not check.ok and "totals wrong" in check.problem

    # a customer never emitted (records lost)
    keep = pc.not_equal(table.column("customer_id"), int(ids[-1]))
    check = orders.verify_totals(table.filter(keep), 5000, 37)
    assert not check.ok and "missing" in check.problem


def test_expected_totals_match_plain_python():
    ids, totals = orders.expected_totals(3000, 11)
    direct: dict[int, int] = {}
    for v in range(3000):
        customer = (v * 7919) % 11
        cents = 100 + ((v * 2654435761) & 0xFFFFFFFF) % 49_900
        direct[customer] = direct.get(customer, 0) + cents
    assert dict(zip(ids.tolist(), totals.tolist(), strict=True)) == direct
