"""Param offload: the routed experts' model state (weights and fp32 ``main_grad``) in the
host tier, each MoE layer's weights fetched one layer ahead into a device slot and its weight
gradient drained back as the layer's backward ends (architecture.md §2.7).

``plan`` is pure (sizes, slots, bytes moved); ``offload`` moves the bytes; ``boundary`` marks
a layer's span in the autograd graph so the moves happen at the right points."""

from megatron_flat.params.boundary import offloaded_layer
from megatron_flat.params.offload import ParamOffload, ParamOffloadError
from megatron_flat.params.plan import LayerLayout, ParamOffloadPlan, TensorPlace, layer_layout

__all__ = ["LayerLayout", "ParamOffload", "ParamOffloadError", "ParamOffloadPlan",
           "TensorPlace", "layer_layout", "offloaded_layer"]
