"""Published long-context runs without megatron-flat, and the plan beside them.

``published.json`` (this package) records measured runs of the PyTorch long-context recipe
(Hugging Face TRL, accelerate) with the configuration each ran. ``matching(model, gpus,
seq, device)`` gives the runs of that model at that length on that many GPUs of that kind,
each with what the planner's ``fsdp2-cp`` predicts for it under its own configuration
(``Fsdp2CP`` knobs and layout), so ``plan`` can answer "what do I gain over my TRL run" at
the same length and GPUs, not only how far flat goes. Measured figures are the sources';
everything else is a planner prediction.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List

from megatron_flat.plan.model import Layout, ModelSpec
from megatron_flat.plan.peaks import PeakReport, estimate
from megatron_flat.plan.recipes import Fsdp2CP

__all__ = ["PATH", "Published", "load", "matching"]

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published.json")
GB = 10 ** 9  # the sources' GB


@dataclass(frozen=True)
class Published:
    """One published run and the planner's prediction of it (``report``: ``fsdp2-cp`` with
    the run's recipe on its layout)."""

    point: dict
    report: PeakReport

    @property
    def peak_bytes(self) -> int:
        return int(self.point["peak_gb"] * GB)


def load(kind: str = "points") -> List[dict]:
    """Every recorded point of ``kind``: ``"points"`` (measured peak and step at a length)
    or ``"reach_points"`` (lengths a recipe trained at)."""
    with open(PATH, encoding="utf-8") as f:
        return json.load(f)[kind]


def matching(model: ModelSpec, gpus: int, seq_len: int, device: str) -> List[Published]:
    """The recorded runs of ``model`` at ``seq_len`` tokens on ``gpus`` GPUs of ``device``'s
    kind (``"H100"`` matches ``"H100"``; case-insensitive)."""
    out = []
    for point in load():
        if (point["model"], point["seq"], point["gpus"]) != (model.name, seq_len, gpus):
            continue
        if point["gpu"].lower() != str(device).lower():
            continue
        layout = Layout(**point["layout"])
        report = estimate(model, layout, seq_len, baseline="fsdp2-cp",
                          recipe=Fsdp2CP(**point["recipe"]))
        out.append(Published(point, report))
    return out
