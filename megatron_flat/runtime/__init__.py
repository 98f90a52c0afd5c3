"""Runtime support: memory metering, the host pool, and device-agnostic streams."""

from megatron_flat.runtime.host_pool import HostPool
from megatron_flat.runtime.memory import MemoryMeter
from megatron_flat.runtime.streams import (
    Event,
    Stream,
    current_stream,
    record_stream,
    use_stream,
)

__all__ = [
    "Event",
    "HostPool",
    "MemoryMeter",
    "Stream",
    "current_stream",
    "record_stream",
    "use_stream",
]
