"""What ``rayflow run`` says and returns when the job does not end well: rayflow's own
verdict in one line and exit 1, never a traceback into rayflow (no Ray is started)."""

from __future__ import annotations

import pytest

from rayflow import cli


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started: the job must end before")

    monkeypatch.setattr("rayflow.environment.ensure_ray", refuse)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(body)
    return str(path)


def test_a_job_refused_before_it_deploys_is_one_line_and_exit_1(tmp_path, capsys, no_ray):
    missing = tmp_path / "orders.jsonl"
    job = _script(
        tmp_path,
        "from rayflow import FileSource, StreamExecutionEnvironment\n"
        "from sinks.basic import PrintSink\n"
        "env = StreamExecutionEnvironment.get_execution_environment()\n"
        f"env.from_source(FileSource({str(missing)!r}, 'jsonl'), 'Orders').sink_to(PrintSink())\n"
        "env.execute('refused')\n",
    )
    assert cli.main(["run", job]) == 1
    err = capsys.readouterr().err
    assert "rayflow run: PreflightError: job 'refused' cannot start" in err
    assert f"no such file or directory: {str(missing)!r}" in err
    assert "Traceback" not in err


def test_a_finished_job_whose_result_was_lost_says_so_in_one_line(tmp_path, capsys, no_ray):
    """The job master was lost after the job FINISHED: the driver says the output is
    complete; ``rayflow run`` passes that on, without a traceback."""
    job = _script(
        tmp_path,
        "from rayflow import JobResultLostError\n"
        "raise JobResultLostError(\"job 'nightly' FINISHED: ... what its sinks committed is "
        'complete")\n',
    )
    assert cli.main(["run", job]) == 1
    err = capsys.readouterr().err
    assert "rayflow run: JobResultLostError: job 'nightly' FINISHED" in err
    assert "Traceback" not in err
