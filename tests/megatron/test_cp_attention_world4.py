"""ContextParallelCoreAttention at CP 4 (eight chunks, each rank two of them): the world-2
file's equivalence test, run over four ranks."""


import pytest

pytestmark = pytest.mark.world(4)

from tests.megatron import test_cp_attention_world2 as _world2

test_cp_equals_single_rank = _world2.test_cp_equals_single_rank
