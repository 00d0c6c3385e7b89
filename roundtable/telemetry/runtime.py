"""The Temporal runtime of a worker process: where its metrics are served.

``PrometheusConfig`` starts an HTTP server (in the SDK's native core) that
serves the SDK's own metrics and whatever is recorded on the runtime's meter,
ours included (roundtable/telemetry/metrics.py), at ``/metrics``.
"""

from __future__ import annotations

from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from roundtable.ports import port_holder
from roundtable.telemetry.metrics import BUCKETS


class MetricsAddressError(RuntimeError):
    """The metrics address is malformed or held by another process."""


def metrics_runtime(address: str) -> Runtime:
    """A runtime serving Prometheus on ``address`` (host:port). A held port
    names its holder: several workers on one host need one address each."""
    config = PrometheusConfig(
        bind_address=address,
        durations_as_seconds=True,
        histogram_bucket_overrides={name: list(bounds) for name, bounds in BUCKETS.items()},
    )
    try:
        return Runtime(telemetry=TelemetryConfig(metrics=config))
    except ValueError as exc:
        said = f"cannot serve metrics on {address}: {exc}"
        port = address.rpartition(":")[2]
        holder = port_holder(int(port)) if port.isdigit() else None
        if holder is not None:
            said += f" (held by {holder})"
        raise MetricsAddressError(
            f"{said}; set ROUNDTABLE_WORKER_METRICS_ADDRESS to a free host:port for each "
            "worker on this host, or to an empty value for no metrics"
        ) from exc
