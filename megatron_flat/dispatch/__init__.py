"""PipelinedLLEP: least-loaded, chunk-capped MoE dispatch (architecture.md §2.1).

``plan`` holds the pure planning API (LLEP plan, chunk counts and membership, route
destinations, send matrices, the receive bound); ``schedule`` turns a plan into per-chunk
send/receive/weight schedules; ``llep`` is the engine (``PipelinedLLEP``, unchunked LLEP
with ``mode="llep"``), which runs one call as a ``step`` (state and data movement), its
``passes`` (the forward and backward loops over the chunks) and each chunk's way from
forward to backward (``strategies``), over the EP group's all-to-alls in ``exchange``;
``recompute`` makes a checkpoint's re-run graph-only (these five are not re-exported).
``experts`` is the expert-bank protocol the engine computes with; ``profiles`` the
synthetic routings used by benchmarks. The Megatron MoE layer built on
this is ``megatron_flat.megatron.moe.FlatMoELayer``. The package namespace re-exports each
module's ``__all__``.
"""

from megatron_flat.dispatch import exchange, experts, llep, plan, profiles, schedule  # noqa: F401
from megatron_flat.dispatch.experts import *  # noqa: F401,F403
from megatron_flat.dispatch.llep import *  # noqa: F401,F403
from megatron_flat.dispatch.plan import *  # noqa: F401,F403
from megatron_flat.dispatch.profiles import *  # noqa: F401,F403
from megatron_flat.dispatch.schedule import *  # noqa: F401,F403

__all__ = sorted({name for module in (experts, llep, plan, profiles, schedule)
                  for name in module.__all__})
