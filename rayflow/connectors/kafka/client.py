"""The Kafka client library and client settings: loaded on first use, secrets kept out
of every repr, log line and error message.

Settings are librdkafka's (``bootstrap.servers``, ``security.protocol``,
``sasl.mechanism``, ``sasl.username``, ``sasl.password``, ``ssl.ca.location``, ...),
passed through to the client as given. :class:`ClientSettings` holds them; its repr,
and :meth:`ClientSettings.redact` for any text that may quote them, replace the value
of every secret setting (a key naming a password, secret, token, private key or JAAS
config) with ``***``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ClientSettings", "KafkaConnectorError", "client_library", "SECRET_KEYS"]

#: Settings whose values are secrets: never shown.
SECRET_KEYS = re.compile(
    r"password|secret|token|jaas|\.key\.pem|keystore|private|credential", re.IGNORECASE
)
#: The shortest secret value that is also searched for in text to redact it (shorter
#: values would blank out unrelated words).
_MIN_REDACTED_LEN = 4


class KafkaConnectorError(RuntimeError):
    """A Kafka source or sink cannot do its work (the reason is in the message)."""


def client_library() -> Any:
    """The ``confluent_kafka`` module (with its admin submodule), or a clear error."""
    try:
        import confluent_kafka
        import confluent_kafka.admin  # noqa: F401 - a submodule the package does not load
    except ImportError:
        raise KafkaConnectorError(
            "the Kafka connectors need confluent-kafka: pip install 'rayflow[kafka]' "
            "(or pip install confluent-kafka)"
        ) from None
    return confluent_kafka


@dataclass(frozen=True)
class ClientSettings:
    """librdkafka settings for every client a connector makes (secrets never shown)."""

    values: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [k for k in self.values if not isinstance(k, str)]
        if bad:
            raise TypeError(f"Kafka client settings: keys must be strings, got {bad!r}")
        object.__setattr__(self, "values", dict(self.values))

    def with_values(self, **values: Any) -> ClientSettings:
        """A copy with ``values`` set (keys with dots, given as a mapping by callers)."""
        return ClientSettings({**self.values, **values})

    def merged(self, values: Mapping[str, Any]) -> ClientSettings:
        return ClientSettings({**self.values, **values})

    @property
    def bootstrap_servers(self) -> str:
        return str(self.values.get("bootstrap.servers", ""))

    def client_config(self, **overrides: Any) -> dict[str, Any]:
        """The configuration dict for a client: these settings, then ``overrides``
        (keys with dots, passed as a mapping: ``**{"group.id": ...}``)."""
        return {**self.values, **overrides}

    def secrets(self) -> list[str]:
        return [
            str(v)
            for k, v in self.values.items()
            if SECRET_KEYS.search(k) and v is not None and len(str(v)) >= _MIN_REDACTED_LEN
        ]

    def shown(self) -> dict[str, Any]:
        """The settings with secret values replaced by ``***``."""
        return {k: ("***" if SECRET_KEYS.search(k) else v) for k, v in self.values.items()}

    def redact(self, text: str) -> str:
        """``text`` with every secret value replaced by ``***``."""
        for secret in sorted(self.secrets(), key=len, reverse=True):
            text = text.replace(secret, "***")
        return text

    def __repr__(self) -> str:
        return f"ClientSettings({self.shown()!r})"
