"""Kafka under seeded kills, against the test broker (tests/kafka_broker.py): a Kafka
source into a keyed sum into CollectSink, and a Kafka source into a Kafka sink
(EXACTLY_ONCE) read back with a read_committed ``assign()`` consumer. Four kills per run,
one per attempt, among them one between a checkpoint's completion and its commit and, for
the Kafka sink, one inside a commit after its records reached the broker
(tests/chaos/kafka_harness.py says which and how the output is checked).

``python tests/chaos/run_kafka_seeds.py --seeds 100`` runs many seeds.
"""

from __future__ import annotations

import pytest

pytest.importorskip("confluent_kafka")

from tests.chaos.kafka_harness import chaos_plan, run_pipeline  # noqa: E402


@pytest.mark.chaos
# kafka 4: the job master dies before it notifies; kafka 11: a commit stalls while the
# other sink subtask dies (its thread outlives its attempt)
@pytest.mark.parametrize(("pipeline", "seed"), [("sum", 3), ("kafka", 4), ("kafka", 11)])
def test_kafka_pipeline_exact_under_seeded_kills(kafka_broker, tmp_path, pipeline, seed):
    run = run_pipeline(
        kafka_broker, pipeline, str(tmp_path), plan=chaos_plan(seed, pipeline), seed=seed
    )
    print(run.line())
    assert run.kills >= 3, run.failures
    assert run.ok, run.problems
