"""The step-time model: each term as documented, overlap per schedule, bad input refused."""

import math

import pytest

from megatron_flat.plan import PlanError
from megatron_flat.plan.time import (
    DEVICES,
    Overlap,
    device,
    overlap_for,
    predict,
    predict_step,
    subtract,
)

H200 = DEVICES["H200"]


def test_reference_device_constants() -> None:
    assert H200.flops == 989e12 and H200.hbm_bytes_per_s == 4.8e12
    assert H200.link_bytes_per_s == 450e9 and H200.pcie_bytes_per_s == 55e9
    with pytest.raises(PlanError, match="unknown device"):
        device("TPU")


def test_zero_counts_predict_zero() -> None:
    p = predict({})
    assert p.total_s == 0 and not p.launch_bound
    assert p.as_dict()["predicted"] is True


def test_compute_is_flops_at_efficiency_plus_memory_traffic() -> None:
    p = predict({"flops": 1e15, "mem_bytes": 4.8e12})
    want = 1e15 / (989e12 * H200.matmul_efficiency) + 1 / H200.hbm_efficiency
    assert math.isclose(p.total_s, want) and math.isclose(p.gpu_s, want)


def test_launch_bound_when_kernels_are_tiny() -> None:
    p = predict({"flops": 1e6, "ops": 1000})
    assert p.launch_bound
    assert math.isclose(p.total_s, 1000 * H200.launch_s)


def test_serial_transfers_add_and_syncs_stall() -> None:
    counts = {"flops": 989e12 * H200.matmul_efficiency, "all_to_all_bytes": 450e9,
              "h2d_bytes": 55e9, "d2h_bytes": 11e9, "syncs": 10,
              "collective_calls": {"all_to_all_single": 4, "recv": 3}}
    p = predict(counts)
    want = 1.0 + (1.0 + 4 * H200.collective_latency_s) + 1.0 + 10 * H200.sync_stall_s
    assert math.isclose(p.total_s, want)
    assert math.isclose(p.exposed_copy_s, 1.0)


def test_host_planning_after_a_sync_is_exposed() -> None:
    """Host work between a sync and the next launch (PipelinedLLEP's plan) idles the GPU:
    it adds to the unit's time in full, beside the sync's own stall."""
    counts = {"flops": 989e12 * H200.matmul_efficiency, "syncs": 2, "host_plan_s": 0.25}
    p = predict(counts)
    assert math.isclose(p.stall_s, 2 * H200.sync_stall_s + 0.25)
    assert math.isclose(p.total_s, 1.0 + 2 * H200.sync_stall_s + 0.25)


def test_flat_moe_layer_charges_host_planning_per_call() -> None:
    """Every PipelinedLLEP call plans on the host (a graph-only re-run too): K·E lists each
    at HOST_PLAN_S_PER_LIST; the stock layer plans nothing."""
    from megatron_flat.plan.costs import HOST_PLAN_S_PER_LIST, moe_layer_counts

    shape = dict(hidden=128, ffn=64, experts=384, tokens=65536, ep=64, routes_computed=5e5,
                 routes_sent=5e5, bytes_per_value=2)
    flat = moe_layer_counts(**shape, flat=True, chunks=10, recompute=True)
    assert math.isclose(flat["host_plan_s"], 2 * HOST_PLAN_S_PER_LIST * 10 * 384)
    assert moe_layer_counts(**shape, flat=True, chunks=10)["host_plan_s"] == \
        flat["host_plan_s"] / 2
    assert moe_layer_counts(**shape, recompute=True).get("host_plan_s", 0) == 0


def test_pipelined_transfer_hides_behind_compute_but_for_one_stage() -> None:
    counts = {"flops": 989e12 * H200.matmul_efficiency, "other_collective_bytes": 450e9 / 2}
    serial = predict(counts, Overlap())
    hidden = predict(counts, Overlap(stages=8, comm_hidden=1.0))
    assert math.isclose(serial.total_s, 1.5)
    # max(0.5, 1)·7/8 + (0.5 + 1)/8: the first transfer is exposed
    assert math.isclose(hidden.total_s, 7 / 8 + 1.5 / 8)
    assert math.isclose(hidden.exposed_comm_s, 0.5 / 8)
    # transfer-bound: compute hides instead
    big = predict({"flops": 989e12 * H200.matmul_efficiency, "h2d_bytes": 4 * 55e9},
                  Overlap(stages=4, copy_hidden=1.0))
    assert math.isclose(big.total_s, 4 * 3 / 4 + 5 / 4)


def test_partially_hidden_schedule() -> None:
    counts = {"flops": 989e12 * H200.matmul_efficiency, "all_to_all_bytes": 450e9}
    p = predict(counts, Overlap(stages=1_000_000, comm_hidden=0.5))
    assert math.isclose(p.total_s, 1.5, rel_tol=1e-5)


def test_bad_overlap_is_refused() -> None:
    with pytest.raises(PlanError):
        Overlap(stages=0)
    with pytest.raises(PlanError):
        Overlap(comm_hidden=1.5)
    with pytest.raises(PlanError):
        predict({"flops": -1})


def test_overlaps_are_written_per_technique() -> None:
    for unit in ("moe", "vocab", "sco", "optimizer"):
        stock, flat = overlap_for(unit, "stock", 4), overlap_for(unit, "flat", 4)
        assert stock.comm_hidden == stock.copy_hidden == 0
        assert flat.comm_hidden + flat.copy_hidden > 0 and flat.why
        assert flat.stages == 4
    assert overlap_for("step", "flat").comm_hidden == 0  # a remainder runs serially


def test_step_is_units_plus_serial_rest() -> None:
    unit = {"flops": 1e14, "all_to_all_bytes": 1e9}
    step = {"flops": 3e14, "all_to_all_bytes": 1e9, "syncs": 4}
    out = predict_step(step, {"moe": (unit, overlap_for("moe", "flat", 4))})
    rest = subtract(step, [unit])
    assert rest["flops"] == 2e14 and rest["all_to_all_bytes"] == 0 and rest["syncs"] == 4
    assert math.isclose(out["total_s"], out["units"]["moe"].total_s + predict(rest).total_s)
    assert out["predicted"] is True


def test_kernel_profile_charges_each_class_at_its_rate() -> None:
    """With the ledger's kernel profile, GEMMs pay for the SMs their last wave leaves idle,
    tiny kernels their minimum time, atomics their rate; copies are the copy term's."""
    from megatron_flat.plan.time import kernel_seconds

    dev = H200
    full = dev.flops * dev.matmul_efficiency
    hbm = dev.hbm_bytes_per_s * dev.hbm_efficiency
    # 132 tiles fill the SMs; 133 tiles take two waves, the second nearly empty
    assert math.isclose(kernel_seconds({"gemm:132": [1, 1e12, 0]}, dev), 1e12 / full)
    assert math.isclose(kernel_seconds({"gemm:133": [1, 1e12, 0]}, dev),
                        1e12 / (full * 133 / 264))
    assert math.isclose(kernel_seconds({"gemm:0": [1, 1e12, 0]}, dev), 1e12 / full)
    # 1,000 tiny kernels cost their floor each; a big one its bytes
    assert math.isclose(kernel_seconds({"mem:3": [1000, 0, 8000]}, dev),
                        1000 * dev.kernel_floor_s)
    assert math.isclose(kernel_seconds({"mem:33": [1, 0, 1e10]}, dev), 1e10 / hbm)
    assert math.isclose(kernel_seconds({"atomic16": [2, 1e9, 4e9]}, dev),
                        max(1e9 / dev.atomic16_per_s, 4e9 / hbm))
    assert kernel_seconds({"copy": [5, 0, 1e12]}, dev) == 0
    with pytest.raises(PlanError, match="unknown kernel class"):
        kernel_seconds({"tensorcore:1": [1, 1, 1]}, dev)


def test_a_profile_replaces_the_aggregate_gpu_time() -> None:
    counts = {"flops": 1e15, "mem_bytes": 1e12, "ops": 3,
              "kernels": {"gemm:0": [1, 1e15, 0], "atomic16": [2, 1e9, 0]}}
    p = predict(counts)
    assert math.isclose(p.gpu_s, 1e15 / (989e12 * H200.matmul_efficiency)
                        + 1e9 / H200.atomic16_per_s)


def test_replaced_constants_are_checked() -> None:
    slow = H200.replaced(matmul_efficiency=0.3)
    assert slow.matmul_efficiency == 0.3 and slow.name == "H200"
    with pytest.raises(PlanError, match="unknown device constant"):
        H200.replaced(warp_speed=1.0)
    with pytest.raises(PlanError, match="must be > 0"):
        H200.replaced(launch_s=0)


def test_an_fp32_matmul_runs_at_the_fp32_rate() -> None:
    from megatron_flat.plan.time import kernel_seconds

    bf16 = kernel_seconds({"gemm:0": [1, 1e12, 0]}, H200)
    fp32 = kernel_seconds({"gemm32:0": [1, 1e12, 0]}, H200)
    assert math.isclose(fp32 / bf16, H200.flops / H200.fp32_flops)


def test_a_gpu_is_predicted_as_the_model_its_name_names() -> None:
    from megatron_flat.plan.time import model_of

    assert model_of("NVIDIA H100 80GB HBM3") == "H100"
    assert model_of("NVIDIA H200") == "H200"
    assert model_of("NVIDIA A100-SXM4-80GB") == "H200" and model_of("cpu", "H100") == "H100"
