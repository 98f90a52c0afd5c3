"""Every method OffloadStreamAdamW's Megatron integration replaces on an optimizer instance
exists on the installed megatron-core's classes with the parameters the replacement passes
(run on 0.16.1 and 0.19.2 in CI): a renamed or reshaped method fails here, not mid-training."""

import inspect

import pytest

from megatron_flat.megatron import optimizer as glue


def _owners(when):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    if when in ("distributed", "precision_aware"):
        return [DistributedOptimizer]
    return [DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer]


@pytest.mark.parametrize("patch", glue.WRAPPER_PATCHES, ids=lambda p: f"{p.when}-{p.method}")
def test_patched_methods_have_the_expected_signature(megatron_cpu, patch):
    assert patch.when in ("always", "offloaded", "distributed", "precision_aware")
    assert len(patch.why) > 20
    for owner in _owners(patch.when):
        method = getattr(owner, patch.method, None)
        assert callable(method), f"{owner.__name__}.{patch.method} is gone"
        params = list(inspect.signature(method).parameters)
        assert params[0] == "self"
        assert tuple(params[1:1 + len(patch.params)]) == patch.params, (
            f"{owner.__name__}.{patch.method}{inspect.signature(method)}: the patch calls it "
            f"with {patch.params}")


def test_every_instance_patch_is_in_the_table():
    """The integration patches instances only through WRAPPER_PATCHES."""
    source = inspect.getsource(glue)
    assigned = {line.split("wrapper.", 1)[1].split(" ", 1)[0]
                for line in source.splitlines()
                if line.strip().startswith("wrapper.") and " = types.MethodType(" in line}
    assert assigned <= {p.method for p in glue.WRAPPER_PATCHES}, assigned
