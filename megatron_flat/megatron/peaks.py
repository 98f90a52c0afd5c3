"""Attribute a Megatron GPT step's memory to the four peaks, with the memory meter.

``attach_peak_sections(model, meter)`` hooks a ``GPTModel`` so that the meter records
one section per component (peaks relative to the live bytes when the section starts):

- ``expert dispatch``: each MoE layer, forward (routing, dispatch, experts, combine) and
  backward (from the layer's output grad to its input grad); recompute included.
- ``vocabulary projection + loss``: output layer and cross-entropy, forward and backward
  (with Ring-DTP on: its output module, ``megatron_flat.megatron.vocab``).
- ``attention block``: each layer's self-attention (QKV projection, RoPE, core attention,
  output projection; with the attention tiles on, their tiled projections), forward and
  backward like the dispatch section; recompute included. Not one of the four peaks (it
  is not in ``COMPONENTS``): the fifth term, what the planner calls the layer's working
  set (``plan.peaks.attention_block_section``), reported beside them.
- ``checkpoint boundaries``: what the decoder keeps alive from its forward to its
  backward (with full recompute, the saved layer inputs), measured as live bytes at the
  decoder's exit minus at its entry. Recorded as a held amount, not a transient; the
  pinned host bytes held the same way (SCO's boundaries) as its host figure.

Forward sections use module hooks; backward sections use tensor hooks on the layer's
output (fires first in backward) and input (fires once the layer's input grad exists).
"""

from __future__ import annotations

import gc
from typing import Any, Callable, List

import torch

from megatron_flat.runtime.memory import SectionStats

DISPATCH = "expert dispatch"
VOCAB = "vocabulary projection + loss"
BOUNDARIES = "checkpoint boundaries"
OPTIMIZER = "optimizer step"
COMPONENTS = (DISPATCH, VOCAB, BOUNDARIES, OPTIMIZER)
ATTENTION = "attention block"



class Switch:
    """A meter section opened and closed from two different hooks."""

    def __init__(self, meter, name: str):
        self.meter, self.name, self.cm = meter, name, None

    def on(self, *_: Any) -> None:
        if self.cm is None:
            self.cm = self.meter.section(self.name)
            self.cm.__enter__()

    def off(self, *_: Any) -> None:
        if self.cm is not None:
            cm, self.cm = self.cm, None
            cm.__exit__(None, None, None)


def _first_tensor(value: Any):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    return None


def _grad_hook(tensor, fn: Callable[[], None]) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        tensor.register_hook(lambda grad: (fn(), None)[1])


def _forward_and_backward(module, switch: Switch) -> List[Any]:
    """Section around ``module``'s forward and its backward (see module docstring).

    Recompute runs the forward again inside backward. With a non-reentrant checkpoint
    (SCO) the backward section is already open then, and the recompute may stop early
    (torch's checkpoint early stop), so a pre-hook can fire without its post-hook: the
    hooks keep only the latest call's state (nothing piles up across calls) and a forward
    that starts inside an open section leaves it open.
    """
    call: dict = {}

    def pre(mod, args):
        call["was_open"] = switch.cm is not None
        call["input"] = _first_tensor(args)
        switch.on()

    def post(mod, args, output):
        if not call.pop("was_open", False):
            switch.off()
        _grad_hook(_first_tensor(output), switch.on)
        _grad_hook(call.pop("input", None), switch.off)

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


_FROZEN = [0]  # attached sections whose collects froze the heap (``PeakSections.collect``)


class PeakSections:
    """Handle returned by ``attach_peak_sections``; ``remove()`` detaches every hook.

    The decoder's hooks collect reference cycles at both ends of each forward. A full
    collection walks the whole Python heap (with Megatron imported, ~0.15 s: a third of a
    rehearsal run's time), though the cycles it is after are made by the steps. So the
    first collect also freezes the heap (``gc.freeze``): the objects alive then (modules,
    the model, the optimizer) are left out of every later collection, which walks only
    what was made since, until the last attached sections are removed (``gc.unfreeze``).
    The price: a cycle among objects alive at the first forward that becomes garbage
    while sections are attached is freed at ``remove()`` instead.
    """

    def __init__(self, handles):
        self._handles = handles
        self._froze = False

    def collect(self) -> None:
        gc.collect()
        if not self._froze:
            self._froze = True
            _FROZEN[0] += 1
            gc.freeze()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._froze:
            self._froze = False
            _FROZEN[0] -= 1
            if _FROZEN[0] == 0:
                gc.unfreeze()


def attach_peak_sections(model: torch.nn.Module, meter) -> PeakSections:
    """Hook ``model`` (a GPTModel, possibly wrapped) so ``meter`` gets per-peak sections."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    while hasattr(model, "module"):
        model = model.module
    handles = []
    from megatron.core.transformer.attention import SelfAttention

    for module in model.modules():
        if isinstance(module, MoELayer):
            handles += _forward_and_backward(module, Switch(meter, DISPATCH))
        elif isinstance(module, SelfAttention):
            handles += _forward_and_backward(module, Switch(meter, ATTENTION))

    if getattr(model, "post_process", False):
        # The loss is computed inside GPTModel.forward after the output layer, so the
        # section opens at the output layer and closes when the model's forward returns;
        # in backward it opens at the loss grad and closes at the output layer's input grad.
        vocab = Switch(meter, VOCAB)
        hidden: List[Any] = []

        def out_pre(mod, args):
            vocab.on()
            hidden.append(_first_tensor(args))

        def model_post(mod, args, output):
            if not hidden:
                return
            vocab.off()
            _grad_hook(_first_tensor(output), vocab.on)
            _grad_hook(hidden.pop(), vocab.off)

        handles.append(model.output_layer.register_forward_pre_hook(out_pre))
        # With Ring-DTP on, a forward with labels runs its output module instead of the
        # output layer (which then only serves logits without labels).
        from megatron_flat.megatron.vocab import ring_dtp_output

        ring = ring_dtp_output(model)
        if ring is not None:
            handles.append(ring.register_forward_pre_hook(out_pre))
        handles.append(model.register_forward_hook(model_post))

    decoder = model.decoder
    held = meter.sections.setdefault(BOUNDARIES, SectionStats(BOUNDARIES))
    entry: List[int] = []

    # Tensors caught in reference cycles live until Python's collector runs, whose timing
    # depends on unrelated allocations; collect at both ends so the held amount counts
    # only what the forward really keeps for the backward.
    sections = PeakSections(handles)

    def dec_pre(mod, args):
        sections.collect()
        entry.append((meter.current_device_bytes(), meter.current_host_bytes()))

    def dec_post(mod, args, output):
        sections.collect()
        if entry:
            device, host = entry.pop()
            held.peak_device_bytes = max(held.peak_device_bytes,
                                         meter.current_device_bytes() - device)
            held.peak_host_bytes = max(held.peak_host_bytes, meter.current_host_bytes() - host)
            held.entries += 1

    handles.append(decoder.register_forward_pre_hook(dec_pre))
    handles.append(decoder.register_forward_hook(dec_post))
    return sections
