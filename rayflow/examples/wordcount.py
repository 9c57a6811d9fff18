"""Word count: the smallest complete rayflow job.

rayflow run --example wordcount          # or: python -m rayflow.examples.wordcount
"""

from rayflow import StreamExecutionEnvironment
from sinks.basic import CollectSink

LINES = [
    "to be or not to be",
    "that is the question",
    "whether tis nobler in the mind to suffer",
    "the slings and arrows of outrageous fortune",
]


def split_words(record: dict) -> list[dict]:
    return [{"word": word} for word in record["line"].split()]


def main() -> None:
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    sink = CollectSink()
    (
        env.from_collection([{"line": line} for line in LINES], "Lines")
        .flat_map(split_words, "Split")
        .key_by("word")
        .count("Count")
        .sink_to(sink, "Counts")
    )
    result = env.execute("wordcount")
    counts: dict[str, int] = {}
    for row in result.sink_result(sink).to_pylist():
        counts[row["word"]] = row["count"]  # the last running count per word is its total
    for word, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:5]:
        print(f"{word:>10} {count}")


if __name__ == "__main__":
    main()
