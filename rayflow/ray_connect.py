"""Before ``ray.init``: is there a Ray cluster at the address, and a quiet local start.

``check_address`` answers within seconds whether a Ray cluster listens at an address
(``host:port``, ``ray://host:port``, or ``auto``: the cluster this machine last
started), where ``ray.init`` would retry and warn for a long time; it raises
:class:`NoRayClusterError` when nothing answers there, or something that is not Ray's
GCS (a proxy, another service).

``quiet_local_start`` is for the local Ray that rayflow starts itself: Ray enables token
authentication for a new local cluster by default and warns about it on every start. The
authentication stays as Ray sets it; only that one warning is filtered out of Ray's log,
and only when rayflow starts the local Ray (joining a user's cluster changes nothing).
"""

from __future__ import annotations

import logging
import socket
import threading

__all__ = ["NoRayClusterError", "check_address", "quiet_local_start", "CONNECT_TIMEOUT_S"]

#: how long the probe of an address waits for a TCP connection
CONNECT_TIMEOUT_S = 3.0


class NoRayClusterError(ConnectionError):
    """Nothing answers at the Ray address given."""


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` or ``ray://host:port``; None for other forms."""
    rest = address
    for scheme in ("ray://", "rayclient://"):
        if rest.startswith(scheme):
            rest = rest[len(scheme) :]
            break
    else:
        if "://" in rest:
            return None
    rest = rest.split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


_UNKNOWN = "?"


def _auto_address() -> str | None:
    """The address ``ray.init(address="auto")`` would use: None when none is recorded,
    ``_UNKNOWN`` when this Ray cannot say."""
    try:
        from ray._private import services

        return services.canonicalize_bootstrap_address("auto") or None
    except Exception:  # noqa: BLE001 - an API this Ray version lacks, or an odd record
        return _UNKNOWN


def check_address(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`NoRayClusterError` when nothing listens at ``address`` (``local``
    and forms this cannot probe pass)."""
    if address in ("local", ""):
        return
    target = address
    if address == "auto":
        target = _auto_address() or ""
        if target == _UNKNOWN:
            return
        if not target:
            raise NoRayClusterError(
                "no Ray cluster at 'auto': none was started on this machine "
                "(start one with 'ray start --head', or leave --address out for a local Ray)"
            )
    where = _host_port(target)
    if where is None:
        return
    shown = address if target == address else f"{address} ({target})"
    hint = (
        "start one with 'ray start --head', or leave --address (and RAY_ADDRESS) out for a "
        "local Ray"
    )
    try:
        with socket.create_connection(where, timeout=timeout_s):
            pass
    except OSError as exc:
        raise NoRayClusterError(
            f"no Ray cluster at {shown}: nothing answers there ({exc.strerror or exc}); {hint}"
        ) from None
    if "://" not in target:  # a GCS address (a Ray client server speaks another protocol)
        problem = _not_a_gcs(f"{where[0]}:{where[1]}", timeout_s)
        if problem is not None:
            raise NoRayClusterError(
                f"no Ray cluster at {shown}: something answers there, but not Ray "
                f"({problem}); {hint}"
            )


def _not_a_gcs(address: str, timeout_s: float) -> str | None:
    """Why what answers at ``address`` is no Ray GCS; None when it is one, or when that
    cannot be told (then ``ray.init`` decides)."""
    try:
        from ray._raylet import InnerGcsClient
    except ImportError:
        return None
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            InnerGcsClient.standalone(address, None, int(timeout_s * 1000))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - judged below
            outcome.append(exc)

    thread = threading.Thread(target=connect, name="rayflow-gcs-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 2.0)
    if not outcome or outcome[0] is None:
        return None
    error = outcome[0]
    if type(error).__name__ != "RpcError" or "timed out" in str(error).lower():
        return None  # an authentication error means a cluster is there; a timeout, unclear
    return str(error).strip().splitlines()[0]


#: the Ray logger that warns that a new local cluster has token authentication on
_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class _DropTokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


def quiet_local_start() -> None:
    """Drop Ray's notice that the local Ray rayflow is about to start has token
    authentication on (the authentication itself is unchanged)."""
    logger = logging.getLogger(_AUTH_LOGGER)
    if not any(isinstance(f, _DropTokenAuthNotice) for f in logger.filters):
        logger.addFilter(_DropTokenAuthNotice())
