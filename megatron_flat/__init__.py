"""megatron-flat: flatten the four memory peaks of long-context MoE training.

The techniques (PipelinedLLEP, Ring-DTP, SCO, OffloadStreamAdamW) change only the order and
granularity of computation and data movement, never the math. Nothing here imports
megatron-core except the adapters in ``megatron_flat.megatron``.
"""

from megatron_flat.config import FlatConfig, add_flat_args
from megatron_flat.megatron.install import install
from megatron_flat.megatron.release import release

__version__ = "0.1.0"

__all__ = ["FlatConfig", "add_flat_args", "install", "release", "__version__"]
