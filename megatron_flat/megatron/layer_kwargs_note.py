"""Silence one Megatron warning about the flat MoE layer, and only that one.

``TransformerLayer.__init__`` chooses the keyword arguments of its ``mlp`` by comparing the spec's
module with a fixed tuple (``MoELayer``, the expert classes, ``MLP``); a subclass such as
``FlatMoELayer`` is not in it, so every layer built logs "Unknown MLP type: <class 'ModuleSpec'>.
Using default kwargs." and builds the layer with its defaults (the flat layer then takes its
process groups from Megatron's parallel state, as ``MoELayer`` does without ``pg_collection``).
The warning says nothing the user can act on, but it is printed per layer per model, dozens of
times in a run. :class:`FlatMoEKwargsFilter` drops a record of that text only when the layer
being built is a flat MoE layer: it finds ``TransformerLayer.__init__``'s ``submodules`` on the
call stack of the logging call; any other unknown MLP still warns.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["FlatMoEKwargsFilter", "install_filter"]

_LOGGER = "megatron.core.transformer.transformer_layer"
_TEXT = "Unknown MLP type:"
_DEPTH = 12  # frames from the filter up to TransformerLayer.__init__ (logging + log_single_rank)


_SILENCED: set = set()  # the MoE layer classes whose construction is not worth a warning


def _building_flat_moe_layer() -> bool:
    from megatron_flat.megatron import compat

    frame = sys._getframe(2)
    for _ in range(_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_name == "__init__" and "submodules" in frame.f_locals:
            mlp = getattr(frame.f_locals["submodules"], "mlp", None)
            module = compat.moe_spec_module(mlp) if mlp is not None else None
            return isinstance(module, type) and issubclass(module, tuple(_SILENCED))
        frame = frame.f_back
    return False


class FlatMoEKwargsFilter(logging.Filter):
    """Drops Megatron's "Unknown MLP type" record for a flat MoE layer (see the module doc)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_TEXT):
            return True
        return not _building_flat_moe_layer()


def install_filter(layer_class: type) -> None:
    """Attach the filter to Megatron's transformer-layer logger (once per process) and drop the
    warning for ``layer_class`` (and its subclasses)."""
    _SILENCED.add(layer_class)
    logger = logging.getLogger(_LOGGER)
    if not any(isinstance(f, FlatMoEKwargsFilter) for f in logger.filters):
        logger.addFilter(FlatMoEKwargsFilter())
