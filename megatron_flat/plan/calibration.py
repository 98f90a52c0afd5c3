"""Device constants from measurements: a calibrate run's, or held-out recorded units'.

Two ways to give the step-time model (:mod:`megatron_flat.plan.time`) the constants of the
GPU a run had, instead of the published figures and stated assumptions it starts from:

* :func:`calibrated_device`: the constants ``benchmarks/gpu_calibrate.py`` measured with
  microbenchmarks (a kernel launch, a sync's round trip, pinned copies, GEMMs at the units'
  shapes, a large elementwise kernel, 16/32-bit atomic adds). Nothing is fitted: each
  constant is one microbenchmark's figure.
* :func:`leave_one_out`: for recorded units (counts and measured seconds from one run), each
  unit is predicted with constants fitted to *the other* units only, so no unit's prediction
  has seen its own time. It tests whether one set of device constants explains every unit,
  which is the model's claim, when no calibrate run was recorded.

The fit (:func:`fit_device`) moves a few constants (:data:`FIT_CONSTANTS`) by factors in
[1/16, 16] to minimise the squared log-ratios of predicted to measured time, with a small
pull toward the starting value so that a constant no training unit depends on stays put.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from megatron_flat.plan.model import PlanError
from megatron_flat.plan.time import DeviceModel, Overlap, device, overlap_for, predict

__all__ = ["CALIBRATED", "FIT_CONSTANTS", "calibrated_device", "fit_device", "leave_one_out",
           "predict_records", "ratio_within"]

# The DeviceModel constants a calibrate run measures, under their own names.
CALIBRATED = ("launch_s", "api_call_s", "sync_stall_s", "kernel_floor_s", "pcie_bytes_per_s",
              "matmul_efficiency", "hbm_efficiency", "atomic16_per_s", "atomic32_per_s")

# The constants a held-out fit may move: the rates a device reaches below its datasheet
# (GEMM and memory efficiency, atomics, pinned copies). The host's time per op and a sync's
# stall are the host's, not the device's, and few units depend on them: they stay as the
# device model (or a calibrate run) gives them.
FIT_CONSTANTS = ("matmul_efficiency", "hbm_efficiency", "atomic16_per_s", "pcie_bytes_per_s")
_FACTORS = [2 ** (k / 8) for k in range(-32, 33)]  # 1/16 .. 16 in eighth-octave steps
_PULL = 0.01  # weight of log(factor)^2 per constant: a tie-breaker, not a prior


def calibrated_device(calibration: Mapping[str, Any], base: Any = None) -> DeviceModel:
    """The device a calibrate run describes: ``base`` (its ``device`` name by default) with
    every constant the run measured replaced. ``PlanError`` for an unknown device."""
    name = base or calibration.get("device_model") or "H200"
    dev = device(name) if isinstance(name, str) else name
    measured = calibration.get("constants", calibration)
    return dev.replaced(**{k: float(v) for k, v in measured.items()
                           if k in CALIBRATED and v is not None})


def _overlap(record: Mapping[str, Any]) -> Overlap:
    return overlap_for(record["unit"], record["variant"], int(record.get("stages", 1)))


def predict_records(records: Sequence[Mapping[str, Any]], dev: DeviceModel) -> list[float]:
    """Predicted seconds of each record (``counts``, ``unit``, ``variant``, ``stages``)."""
    return [predict(r["counts"], _overlap(r), dev).total_s for r in records]


def _loss(records: Sequence[Mapping[str, Any]], dev: DeviceModel,
          factors: Mapping[str, float]) -> float:
    moved = dev.replaced(**{k: getattr(dev, k) * f for k, f in factors.items()})
    err = 0.0
    for r, p in zip(records, predict_records(records, moved)):
        err += math.log(max(p, 1e-12) / float(r["measured_s"])) ** 2
    return err + _PULL * sum(math.log(f) ** 2 for f in factors.values())


def fit_device(records: Sequence[Mapping[str, Any]], dev: DeviceModel,
               constants: Sequence[str] = FIT_CONSTANTS, rounds: int = 4) -> DeviceModel:
    """``dev`` with ``constants`` moved to fit ``records`` (coordinate search over factors
    1/16..16; deterministic). ``PlanError`` without records or with a bad constant."""
    if not records:
        raise PlanError("fit_device needs at least one recorded unit")
    for r in records:
        if not float(r.get("measured_s", 0)) > 0:
            raise PlanError(f"recorded unit {r.get('unit')}/{r.get('variant')} has no "
                            f"measured time")
    dev.replaced(**{k: 1.0 for k in constants})  # refuses an unknown constant by name
    factors = {k: 1.0 for k in constants}
    for _ in range(rounds):
        for key in constants:
            best = min(_FACTORS, key=lambda f: _loss(records, dev, {**factors, key: f}))
            factors[key] = best
    return dev.replaced(**{k: getattr(dev, k) * f for k, f in factors.items()})


def leave_one_out(records: Sequence[Mapping[str, Any]], dev: DeviceModel,
                  constants: Sequence[str] = FIT_CONSTANTS) -> list[dict[str, Any]]:
    """Each record predicted by ``dev`` fitted to the others: ``[{unit, variant,
    predicted_s, measured_s, ratio, constants}]`` (``ratio`` = measured / predicted;
    ``constants``: the fitted values that predicted it)."""
    if len(records) < 2:
        raise PlanError("leave_one_out needs at least two recorded units")
    out = []
    for i, held in enumerate(records):
        fitted = fit_device([r for j, r in enumerate(records) if j != i], dev, constants)
        p = predict(held["counts"], _overlap(held), fitted).total_s
        out.append({"unit": held["unit"], "variant": held["variant"], "predicted_s": p,
                    "measured_s": float(held["measured_s"]),
                    "ratio": float(held["measured_s"]) / p,
                    "constants": {k: getattr(fitted, k) for k in constants}})
    return out


def ratio_within(rows: Sequence[Mapping[str, Any]], bound: float) -> list[str]:
    """The rows whose measured/predicted ratio lies outside [1/bound, bound], named."""
    return [f"{r['unit']}/{r['variant']}: {r['ratio']:.2f}x" for r in rows
            if not 1 / bound <= r["ratio"] <= bound]

