"""testing.distributed.layout_group_pool: successive Megatron layouts share process groups,
each layout's groups stay distinct and work, and closing the pool destroys them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.world(2)


def _groups():
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_group(), "dp": ps.get_data_parallel_group(),
            "ep": ps.get_expert_model_parallel_group(),
            "dp_gloo": ps.get_data_parallel_group_gloo()}


def test_layouts_share_groups_that_work_and_closing_destroys_them(megatron_cpu):
    from megatron_flat.testing.distributed import layout_group_pool, live_groups, megatron_layout

    with layout_group_pool() as pool:
        with megatron_layout(tp=2):
            first = _groups()
            total = torch.ones(1)
            dist.all_reduce(total, group=first["tp"])
            assert total.item() == 2
        made = set(pool.groups())
        assert made <= live_groups()  # kept for the next layout
        with megatron_layout(tp=2):
            again = _groups()  # the same layout again: the same groups, none made
        assert all(again[k] is first[k] for k in first) and set(pool.groups()) == made
        with megatron_layout(ep=2):
            other = _groups()
            total = torch.ones(1)
            dist.all_reduce(total, group=other["ep"])
            assert total.item() == 2
            dist.all_reduce(total, group=other["dp_gloo"])
            assert total.item() == 4
            # within one layout the groups over one rank set stay distinct
            assert other["ep"] is not other["dp"] and other["dp"] is not other["dp_gloo"]
        mine = pool.groups()
        assert len(mine) <= 2 * len(made)
    assert not set(mine) & live_groups()


def test_a_pooled_group_destroyed_behind_the_pools_back_is_refused(megatron_cpu):
    from megatron_flat.testing.distributed import layout_group_pool, megatron_layout

    with layout_group_pool() as pool:
        with megatron_layout(tp=2):
            pass
        dist.destroy_process_group(pool.groups()[0])
        with pytest.raises(RuntimeError, match="destroyed outside megatron_layout"):
            with megatron_layout(tp=2):
                pass
