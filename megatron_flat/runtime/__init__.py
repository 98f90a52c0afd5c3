"""Runtime support: memory metering, cost counting, the host pool, and device-agnostic streams."""

from megatron_flat.runtime.host_pool import HostPool
from megatron_flat.runtime.ledger import CostLedger
from megatron_flat.runtime.memory import MemoryMeter
from megatron_flat.runtime.streams import (
    Event,
    Stream,
    current_stream,
    record_stream,
    use_stream,
)

__all__ = [
    "CostLedger",
    "Event",
    "HostPool",
    "MemoryMeter",
    "Stream",
    "current_stream",
    "record_stream",
    "use_stream",
]
