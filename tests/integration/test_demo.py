"""``rayflow demo`` run small, as a user runs it (the CLI, in process, on the suite's Ray):
the three runs get the same seeded kills, and the table says what each guarantee allows.
EXACTLY_ONCE: 0 lost, 0 duplicated; AT_LEAST_ONCE: 0 lost; checkpointing off: the job
fails at its first kill and loses orders, none twice. Exit status 0."""

from __future__ import annotations

import re

import pytest

from rayflow.cli import main as cli_main

RECORDS = 4_000


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """The demo's table, by guarantee: column name -> cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("guarantee "))
    headers = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = dict(zip(headers, cells))
    return rows


def number(cell: str) -> int:
    return int(cell.replace(",", ""))


@pytest.mark.parametrize("sink, failures", [("files", 2), ("s3", 1)])
def test_demo_shows_what_each_guarantee_allows(sink, failures, capsys):
    code = cli_main(
        [
            "demo",
            "--sink",
            sink,
            "--records",
            str(RECORDS),
            "--failures",
            str(failures),
            "--seed",
            "3",
            "--rate",
            "4000",  # about 1 s of input: checkpoints complete between the kills
            "--checkpoint-ms",
            "100",
        ]
    )
    out = capsys.readouterr().out
    print(out)
    rows = table_rows(out)
    assert set(rows) == {"NONE (checkpoints off)", "AT_LEAST_ONCE", "EXACTLY_ONCE"}

    exactly = rows["EXACTLY_ONCE"]
    assert number(exactly["expected"]) == RECORDS
    assert number(exactly["committed"]) == RECORDS
    assert number(exactly["lost"]) == 0
    assert number(exactly["duplicated"]) == 0
    assert exactly["kills"] == f"{failures} of {failures}"

    at_least = rows["AT_LEAST_ONCE"]
    assert number(at_least["lost"]) == 0
    assert number(at_least["committed"]) == RECORDS + number(at_least["duplicated"])
    assert at_least["kills"] == f"{failures} of {failures}"

    # checkpointing off: no restart; the killed subtask's orders after its kill are lost
    off = rows["NONE (checkpoints off)"]
    assert off["kills"] == f"1 of {failures}, job failed"
    assert number(off["lost"]) > 0
    assert number(off["duplicated"]) == 0
    assert number(off["committed"]) + number(off["lost"]) == RECORDS

    assert "GUARANTEE BROKEN" not in out
    assert code == 0


def test_demo_into_postgres_keeps_the_password_out_of_its_output(postgres, capsys):
    db = postgres.create_database()
    try:
        code = cli_main(
            [
                "demo",
                "--sink",
                "postgres",
                "--dsn",
                db.dsn,
                "--records",
                str(RECORDS),
                "--failures",
                "1",
                "--rate",
                "4000",
                "--checkpoint-ms",
                "100",
            ]
        )
        captured = capsys.readouterr()
        rows = table_rows(captured.out)
        assert number(rows["EXACTLY_ONCE"]["lost"]) == 0
        assert number(rows["EXACTLY_ONCE"]["duplicated"]) == 0
        assert number(rows["AT_LEAST_ONCE"]["lost"]) == 0
        assert postgres.password not in captured.out + captured.err
        assert code == 0
        with db.connect() as conn:
            left = conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()
            tables = conn.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
            ).fetchone()
        assert left == (0,)
        assert tables == (0,)  # the demo drops the tables it made
    finally:
        postgres.drop_database(db.name)


# Three jobs, each killed once and restarted, against a broker: about 20 s alone, but
# every kill starts actor processes anew, and under the suite's load (other workers'
# Ray clusters on the same cores) a start took 10-20 s: the three runs have gone past
# the suite's 300 s per test without anything being stuck.
@pytest.mark.timeout(900)
def test_demo_kafka_to_kafka_reads_back_read_committed(kafka_broker, capsys):
    """The seed's pipeline: an orders topic -> enrich -> totals -> a topic per run, read
    back as a read_committed consumer sees it; the demo's topics are deleted after."""
    before = set(kafka_broker.admin().list_topics(timeout=10).topics)
    code = cli_main(
        [
            "demo",
            "--source",
            "kafka",
            "--sink",
            "kafka",
            "--bootstrap-servers",
            kafka_broker.bootstrap_servers,
            "--records",
            str(RECORDS),
            "--failures",
            "1",
            "--rate",
            "4000",
            "--checkpoint-ms",
            "100",
        ]
    )
    out = capsys.readouterr().out
    print(out)
    assert "from topic rayflow-demo-orders-" in out
    rows = table_rows(out)
    exactly = rows["EXACTLY_ONCE"]
    assert number(exactly["committed"]) == RECORDS
    assert number(exactly["lost"]) == 0
    assert number(exactly["duplicated"]) == 0
    assert exactly["kills"] == "1 of 1"
    assert number(rows["AT_LEAST_ONCE"]["lost"]) == 0
    off = rows["NONE (checkpoints off)"]
    assert off["kills"] == "1 of 1, job failed"
    assert number(off["committed"]) + number(off["lost"]) == RECORDS
    assert code == 0
    after = set(kafka_broker.admin().list_topics(timeout=10).topics)
    assert {t for t in after - before if t.startswith("rayflow-demo")} == set()


def test_demo_kafka_options_need_kafka(capsys):
    code = cli_main(["demo", "--sink", "files", "--bootstrap-servers", "127.0.0.1:9"])
    assert code == 2
    assert "need --source or --sink kafka" in capsys.readouterr().err
