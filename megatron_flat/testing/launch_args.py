"""Megatron-LM's parsed arguments as ``install()`` sees them, for tests without Megatron-LM:
an ``argparse.Namespace`` with the ``--flat-*`` flags parsed and Megatron's own settings set
as attributes (an EP-2 MoE model with Adam and no recompute unless overridden)."""

from __future__ import annotations

import argparse

from megatron_flat.config import add_flat_args

__all__ = ["megatron_args"]

BASE = dict(num_experts=4, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
            recompute_granularity=None, optimizer="adam", optimizer_cpu_offload=False)


def megatron_args(*flags: str, **settings) -> argparse.Namespace:
    """``flags`` parsed by ``add_flat_args``; ``settings`` (Megatron's fields) over ``BASE``."""
    args = add_flat_args(argparse.ArgumentParser()).parse_args(list(flags))
    for key, value in {**BASE, **settings}.items():
        setattr(args, key, value)
    return args
