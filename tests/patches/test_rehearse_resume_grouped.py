"""``rehearse --resume-at 2`` on grouped-GEMM lines: a transformer-engine line's experts are
``TEGroupedMLP`` over the CPU grouped linears (``cpu/grouped.py``), and their torch_dist
checkpoints must save, load and cross between stock and flat runs as transformer-engine's
would.

The lines: the production line (transformer-engine, its layer spec, ``--moe-grouped-gemm
--swiglu --bf16``, the distributed optimizer) at EP = world (2 ranks: dense DP 2, expert
DP 1 — the layout whose first save failed when the grouped linears took their replica ids
from the dense DP group; both megatron-core versions), and GPT-OSS's (``--family gpt_oss``:
SwiGLU experts with biases on both linears) at EP 2 × expert DP 2 (4 ranks). The synthetic
checkout's call shape is the installed megatron-core's, so each CI stage rehearses its own
release."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import rehearsal_checkout as checkout  # noqa: E402
from test_rehearse import (_era_of_installed_core, _family_line, _rehearse,  # noqa: E402
                           check_family_run, check_production_run)
from test_rehearse_resume import _events  # noqa: E402

VERDICT = ("rehearsal: flat losses equal stock over 5 iterations{subs}; checkpoints cross "
           "both ways at iteration 2")


def _line(name: str) -> tuple:
    """(the line, the CPU substitutions its verdict counts)."""
    if name == "production":
        return list(checkout.PRODUCTION) + checkout.FLAT, 11
    return _family_line(name) + checkout.FLAT + ["--family", name], 3


def _grouped_experts(work: Path, run: str) -> list:
    """Rank 0's expert parameter names of ``run`` (TEGroupedMLP's: one per expert)."""
    rank = json.loads((work / run / "rank0.json").read_text())
    return [name for _, name, _, _ in rank["parameters"] if ".experts." in name]


def _check(done, work, name: str, subs: int) -> None:
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert out.splitlines()[-1] == VERDICT.format(subs=f" ({subs} CPU substitutions)"), out
    assert "TEGroupedMLP with CPU grouped linears for TE's" in out
    for run in ("stock", "flat"):
        experts = _grouped_experts(work, run)
        assert any(n.endswith("experts.linear_fc1.weight0") for n in experts), experts
        assert any(n.endswith("experts.linear_fc2.bias0") for n in experts) \
            == (name == "gpt_oss"), experts
    for saver in ("stock", "flat"):
        assert (work / "checkpoints" / saver / "iter_0000002").is_dir()
    # every rank loaded exactly what the other run saved (the checkpoints' digests)
    for saver, loader in (("stock", "stock-to-flat"), ("flat", "flat-to-stock")):
        saved = [[e for e in ev if e["op"] == "save" and e["iteration"] == 2]
                 for ev in _events(work, saver)]
        loaded = [[e for e in ev if e["op"] == "load"] for ev in _events(work, loader)]
        assert len(saved) == len(loaded) > 0
        assert [x[0]["digest"] for x in saved] == [x[0]["digest"] for x in loaded]


# Both megatron-core versions rehearse the production line (smoke): the line, and the
# line a GPU job script has (test_rehearse.check_production_run).
@pytest.mark.rehearsal(smoke=True, runs=4)  # stock, flat and a crossing each way
def test_grouped_gemm_checkpoints_cross_at_ep_equal_to_world(tmp_path):
    script = checkout.write_checkout(tmp_path / "mlm", _era_of_installed_core())
    line, subs = _line("production")
    done, work = _rehearse(tmp_path, script, line, nproc=2, options=("--resume-at", "2"))
    _check(done, work, "production", subs)
    check_production_run(done.stdout, work)


@pytest.mark.rehearsal(runs=4)  # stock, flat and a crossing each way
def test_grouped_gemm_checkpoints_cross_at_ep_times_expert_dp(tmp_path):
    """GPT-OSS's line as it is trained (transformer-engine, grouped experts with biases,
    every technique of --flat-preset paper) at EP 2 × expert DP 2 on 4 ranks: the same model
    both ways, flat losses equal stock, and each expert's main replica is expert-DP rank
    0's."""
    script = checkout.write_checkout(tmp_path / "mlm", _era_of_installed_core())
    line, subs = _line("gpt_oss")
    done, work = _rehearse(tmp_path, script, line, nproc=4, options=("--resume-at", "2"))
    _check(done, work, "gpt_oss", subs)
    check_family_run(done.stdout, work, "gpt_oss", nproc=4)
