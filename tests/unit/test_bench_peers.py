"""The peer benchmark (``benchmarks/peers.py``): its expected sums and check, medians,
table, arguments and RESULTS.md section, without running any engine."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    saved = list(sys.path)
    try:
        sys.path.insert(0, str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def peers():
    return _load("peers")


@pytest.fixture(scope="module")
def common(peers):
    return sys.modules["peers_common"]


def _brute_sums(n: int) -> dict[int, int]:
    sums: dict[int, int] = {}
    for i in range(n):
        sums[i % 1000] = sums.get(i % 1000, 0) + i
    return sums


@pytest.mark.parametrize("n", [1, 999, 1000, 1001, 2500, 12_345])
def test_expected_sums_match_brute_force(common, n):
    brute = _brute_sums(n)
    assert {k: common.expected_sum(n, k) for k in range(min(n, 1000))} == brute
    assert common.check_sums(n, brute) == "ok"
    assert common.check_sums(n, brute, count=n) == "ok"


def test_check_names_every_kind_of_wrong_result(common):
    n = 5000
    sums = _brute_sums(n)
    off = {**sums, 7: sums[7] + 1}
    assert common.check_sums(n, off).startswith("WRONG: 1 sums wrong (key 7:")
    missing = {k: v for k, v in sums.items() if k != 3}
    assert "1 of 1000 keys missing (first 3)" in common.check_sums(n, missing)
    assert "unexpected keys" in common.check_sums(n, {**sums, 1000: 1})
    both = common.check_sums(n, off, count=n - 1)
    assert "sums wrong" in both and f"{n - 1} updates, expected {n}" in both


def test_merge_max_and_result_line(common):
    assert common.merge_max([{"1": 5, "2": 9}, {1: 7, "2": 3}]) == {1: 7, 2: 9}
    out = "noise\n" + common.RESULT_PREFIX + '{"a": 1}\nmore\n'
    out += common.RESULT_PREFIX + '{"a": 2}\n'
    assert common.parse_result(out) == {"a": 2}
    assert common.parse_result("nothing here") is None


def _run(peers, config, job_s, check="ok", **kw):
    return peers.Run(config, job_s=job_s, check=check, load=1.0, **kw)


def test_summarize_takes_medians_and_shouts_about_wrong_or_failed_runs(peers):
    config = peers.Config(peers.Engine.RAYFLOW_PER_RECORD, peers.Mode.EXACTLY_ONCE, 1, 1_000_000)
    runs = [_run(peers, config, s, duration_s=s / 2) for s in (1.0, 4.0, 2.0)]
    s = peers.summarize(runs)
    assert s["rate"] == 500_000 and (s["rate_min"], s["rate_max"]) == (250_000, 1_000_000)
    assert s["duration_rate"] == 1_000_000 and s["job_s"] == 2.0
    assert s["check"] == "ok" and not s["bad"] and math.isnan(s["total_rate"])

    wrong = runs[:2] + [_run(peers, config, 1.0, check="WRONG: 1 sums wrong (key 7: 1)")]
    s = peers.summarize(wrong)
    assert s["bad"] and s["check"].startswith("**WRONG** (1/3): 1 sums wrong")

    failed = runs[:1] + [peers.Run(config, error="RuntimeError: boom", load=1.0)]
    s = peers.summarize(failed)
    assert s["bad"] and s["check"] == "**FAILED** (1/2): RuntimeError: boom"
    assert (s["runs"], s["of"], s["rate"]) == (1, 2, 1_000_000)

    sql = peers.Config(peers.Engine.PYFLINK_SQL, peers.Mode.NONE, 1, 1_000_000)
    s = peers.summarize([_run(peers, sql, 2.0, check="unchecked (blackhole sink)")])
    assert s["check"] == "unchecked (blackhole sink)" and not s["bad"]


@pytest.mark.parametrize(("n", "rounds", "times"), [(4, 4, 1), (5, 10, 2), (6, 6, 1)])
def test_every_configuration_follows_every_other_equally_often(peers, n, rounds, times):
    configs = [peers.Config(peers.Engine.BYTEWAX, peers.Mode.NONE, 1, 1000 + i) for i in range(n)]
    order = peers.round_order(configs, rounds)
    assert [r for r, _ in order] == [r for r in range(rounds) for _ in range(n)]
    follows: dict[tuple, int] = {}
    for r in range(rounds):
        row = [c for _, c in order[n * r : n * (r + 1)]]
        assert sorted(row, key=configs.index) == configs  # each once per round
        for before, after in zip(row, row[1:]):
            follows[(before, after)] = follows.get((before, after), 0) + 1
    assert len(follows) == n * (n - 1) and set(follows.values()) == {times}


def test_the_acceptance_plan_gives_bytewax_several_predecessors(peers):
    args = peers.parse_args(["--bytewax", sys.executable, "--pyflink", sys.executable])
    for block in peers.plan(args):
        order = [c for _, c in peers.round_order(block.configs, 5)]
        before = {
            order[i - 1].engine
            for i in range(1, len(order))
            if order[i].engine is peers.Engine.BYTEWAX
        }
        assert len(before) >= 3, block.name


def test_ratios_are_taken_within_a_round_and_skip_failed_runs(peers):
    ours = peers.Config(peers.Engine.RAYFLOW_PER_RECORD, peers.Mode.EXACTLY_ONCE, 1, 1_000_000)
    theirs = peers.Config(peers.Engine.BYTEWAX, peers.Mode.EXACTLY_ONCE, 1, 2_000_000)
    other_mode = peers.Config(peers.Engine.BYTEWAX, peers.Mode.NONE, 1, 1_000_000)
    block = peers.Block("b", (ours, theirs, other_mode))
    results = {
        ours: [_run(peers, ours, s, round=r) for r, s in enumerate((1.0, 2.0, 1.0))],
        theirs: [
            _run(peers, theirs, 4.0, round=0),
            peers.Run(theirs, error="X: y", round=1),
            _run(peers, theirs, 8.0, round=2),
        ],
        other_mode: [_run(peers, other_mode, 100.0, round=r) for r in range(3)],
    }
    [(label, ratios)] = peers.round_ratios([block], results)
    # 1M/1s over 2M/4s, round 1 left out, 1M/1s over 2M/8s: only the same mode compared
    assert ratios == [2.0, 4.0]
    assert label == "rayflow per record EXACTLY_ONCE p=1 N=1M / Bytewax recovery p=1 N=2M"
    assert peers.round_ratios([peers.Block("b", (ours,))], results) == []


def test_table_has_one_row_per_configuration(peers):
    eo = peers.Config(peers.Engine.BYTEWAX, peers.Mode.EXACTLY_ONCE, 2, 2_000_000)
    off = peers.Config(peers.Engine.RAYFLOW_VECTORIZED, peers.Mode.NONE, 1, 20_000_000)
    table = peers.render_table(
        [
            (eo, [_run(peers, eo, 4.0, total_s=5.0, checkpoints=3)]),
            (off, [_run(peers, off, 10.0, checkpoints=0), peers.Run(off, error="X: y")]),
        ]
    )
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].startswith("| engine | mode |")
    assert lines[2].startswith("| Bytewax | recovery | 2 | 2M | 1 | 0.50 M |")
    assert "| 0.40 M |" in lines[2] and "| 3 |" in lines[2]
    assert lines[3].startswith("| rayflow vectorized | none | 1 | 20M | 1 of 2 | 2.00 M |")
    assert "**FAILED** (1/2): X: y" in lines[3]


def test_acceptance_preset_plans_the_baseline(peers):
    args = peers.parse_args(["--bytewax", sys.executable, "--pyflink", sys.executable])
    blocks = peers.plan(args)
    assert [b.name for b in blocks] == [
        "whole job, p=1, N=2M",
        "steady state, p=1, EXACTLY_ONCE",
    ]
    whole = {(c.engine.value, c.mode.value, c.parallelism, c.records) for c in blocks[0].configs}
    engines = ("rayflow-vectorized", "rayflow-per-record", "bytewax", "pyflink-sql")
    for engine in (*engines, "pyflink-sql-mini-batch"):
        for mode in ("none", "exactly-once"):
            assert (engine, mode, 1, 2_000_000) in whole
    assert len(whole) == 10
    steady = {(c.engine.value, c.records) for c in blocks[1].configs}
    assert steady == {
        ("rayflow-vectorized", 20_000_000),
        ("rayflow-per-record", 10_000_000),
        ("bytewax", 10_000_000),
        ("pyflink-sql", 20_000_000),
        ("pyflink-sql-mini-batch", 20_000_000),
    }
    # interleaved: engines alternate within a mode
    assert [c.engine for c in blocks[0].configs[:4]] == list(peers.Engine)[:4]


def test_peers_without_python_are_left_out_and_options_override(peers):
    args = peers.parse_args(["--preset", "full", "--no-steady", "--runs", "1"])
    (block_1, block_2) = peers.plan(args)
    assert {c.engine for c in block_1.configs + block_2.configs} == {
        peers.Engine.RAYFLOW_VECTORIZED,
        peers.Engine.RAYFLOW_PER_RECORD,
    }
    assert {c.parallelism for c in block_2.configs} == {2}
    assert len(block_1.configs) == 8  # 4 modes x 2 rayflow engines

    args = peers.parse_args(
        ["--bytewax", sys.executable, "--modes", "none", "at-least-once", "unaligned"]
        + ["--engines", "bytewax", "--records", "1000", "--no-steady"]
    )
    (block,) = peers.plan(args)
    assert [(c.mode.value, c.records) for c in block.configs] == [("none", 1000)]

    args = peers.parse_args(["--pyflink", sys.executable, "--steady-only"])
    (block,) = peers.plan(args)
    assert block.name == "steady state, p=1, EXACTLY_ONCE"
    assert {c.engine.value for c in block.configs} == {
        "rayflow-vectorized",
        "rayflow-per-record",
        "pyflink-sql",
        "pyflink-sql-mini-batch",
    }

    args = peers.parse_args(
        ["--pyflink", sys.executable, "--datastream", "--engines", "pyflink-datastream"]
    )
    assert [b.name for b in peers.plan(args)] == [
        "PyFlink DataStream, none, p=1",
        "PyFlink DataStream, exactly-once, p=1",
    ]


def test_peer_python_must_exist(peers):
    with pytest.raises(SystemExit):
        peers.parse_args(["--bytewax", "/nonexistent/python"])


def test_transport_limits_are_taken_and_checked(peers, capsys):
    args = peers.parse_args(["--channel-bytes", "4194304", "--inline-bytes", "2097152"])
    assert (args.channel_bytes, args.inline_bytes) == (4194304, 2097152)
    assert peers.parse_args([]).channel_bytes is None
    for flag in ("--channel-bytes", "--inline-bytes"):
        with pytest.raises(SystemExit):
            peers.parse_args([flag, "0"])
        assert f"{flag} 0: must be >= 1" in capsys.readouterr().err


def test_a_channel_bytes_limit_reaches_the_job(peers, tmp_path):
    config = peers.Config(peers.Engine.RAYFLOW_VECTORIZED, peers.Mode.NONE, 1, 10)
    assert peers._rayflow_env(config, str(tmp_path), 12345)._channel_bytes == 12345


def test_peer_command_lines(peers):
    sql = peers.Config(peers.Engine.PYFLINK_SQL, peers.Mode.UNALIGNED, 2, 100)
    cmd = peers.peer_command(sql, "/venv/bin/python")
    assert cmd[0] == "/venv/bin/python" and cmd[1].endswith("peers_pyflink.py")
    assert cmd[2:] == ["--api", "sql", "--records", "100", "--parallelism", "2"] + [
        "--mode",
        "unaligned",
    ]
    mini = peers.Config(peers.Engine.PYFLINK_SQL_MINI_BATCH, peers.Mode.EXACTLY_ONCE, 1, 7)
    assert peers.peer_command(mini, "py")[2:4] == ["--api", "sql-mini-batch"]
    ds = peers.Config(peers.Engine.PYFLINK_DATASTREAM, peers.Mode.NONE, 1, 7)
    assert peers.peer_command(ds, "py")[2:4] == ["--api", "datastream"]
    bw = peers.Config(peers.Engine.BYTEWAX, peers.Mode.EXACTLY_ONCE, 1, 5)
    cmd = peers.peer_command(bw, "py", bytewax_batch_size=100)
    assert cmd[1].endswith("peers_bytewax.py") and cmd[-2:] == ["--batch-size", "100"]


def test_results_section_is_added_then_replaced(peers):
    head = "# Results\n\n## Other\n\ntext\n"
    once = peers.upsert_results(head, "before", "table one", intro="What it is.")
    assert once.startswith(head.rstrip("\n"))
    assert once.count(peers.SECTION) == 1
    assert once.index("What it is.") < once.index("### before\n\ntable one\n")

    twice = peers.upsert_results(once, "after", "table two")
    assert twice.index("### before") < twice.index("### after\n\ntable two")

    replaced = peers.upsert_results(twice, "before", "table three")
    assert "table one" not in replaced and "table three" in replaced
    assert replaced.index("### before") < replaced.index("### after")
    assert replaced.count("### before") == 1 and "table two" in replaced

    # a section after the Peers section is kept where it is
    later = twice + "\n## Later\n\nkept\n"
    again = peers.upsert_results(later, "after", "table four")
    assert again.endswith("## Later\n\nkept\n") and "table two" not in again
    added = peers.upsert_results(later, "third", "t5")
    assert added.index("### third") < added.index("## Later")


def test_count_max_sink_keeps_the_largest_sum_per_key(peers):
    import pyarrow as pa

    writer = peers.CountMaxSink().create_writer(None)
    writer.write(pa.RecordBatch.from_pydict({"key": [1, 2, 1], "value": [5, 3, 9]}))
    writer.write(pa.RecordBatch.from_pydict({"key": [2, 1], "value": [4, 7]}))
    writer.write(pa.RecordBatch.from_pydict({"key": [], "value": []}))
    first = writer.finish()
    assert (first["count"], first["sums"]) == (5, {1: 9, 2: 4})
    assert first["rayflow"] == peers.rayflow.__file__  # the driver checks workers ran its own
    other = {"count": 1, "sums": {2: 8}, "rayflow": first["rayflow"]}
    merged = peers.CountMaxSink().merge_results([first, None, other])
    assert merged == {"count": 6, "sums": {1: 9, 2: 8}, "rayflow": [first["rayflow"]]}


def test_settle_reads_the_cpus_and_gives_up_in_time():
    runner = _load("bench_runner")
    busy = runner.cpu_busy(0.05)
    assert 0.0 <= busy <= 1.0
    waited, last, quiet = runner.settle(threshold=-1.0, window_s=0.05, timeout_s=0.3)
    assert 0.3 <= waited < 1.0 and 0.0 <= last <= 1.0  # never quiet under a threshold of -1
    assert not quiet
    waited, _, quiet = runner.settle(threshold=2.0, quiet_windows=2, window_s=0.05, timeout_s=5)
    assert waited < 1.0 and quiet  # always quiet under a threshold of 2: two windows


def test_waits_are_told_apart_by_the_engine_that_ran_before(peers):
    config = peers.Config(peers.Engine.BYTEWAX, peers.Mode.NONE, 1, 10)
    runs = [
        peers.Run(config, settle_s=8.0, after=peers.Engine.RAYFLOW_PER_RECORD),
        peers.Run(config, settle_s=9.0, after=peers.Engine.RAYFLOW_VECTORIZED),
        peers.Run(config, settle_s=3.0, after=peers.Engine.PYFLINK_SQL),
        peers.Run(config, settle_s=1.0),  # first of its block: no predecessor
    ]
    text = peers._waits_by_predecessor(runs)
    assert "after a rayflow run 8.5 s (2 runs)" in text
    assert "after a peer's run 3.0 s (1 runs)" in text
    assert peers._waits_by_predecessor(runs[3:]) == ""
