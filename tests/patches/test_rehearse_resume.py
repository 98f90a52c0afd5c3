"""``rehearse --resume-at I``: checkpoints cross between stock and flat runs both ways.

Unit tests of the crossing's verdict (no launches), then real rehearsals of the synthetic
checkout (``rehearsal_checkout``, torch_dist checkpoints through Megatron-Core's
``dist_checkpointing``): with the distributed optimizer and OffloadStreamAdamW, without the
distributed optimizer, and a lossy crossing that must be caught."""

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_flat.rehearse import command as rehearse
from megatron_flat.rehearse import resume as cpu_resume

sys.path.insert(0, str(Path(__file__).parent))
import rehearsal_checkout as checkout  # noqa: E402
from test_rehearse import _rehearse, check_call_shape_run  # noqa: E402

DIGEST = {"exp_avg": "a", "exp_avg_sq": "b", "master": "c", "step": "d"}


def _run(name, losses, events=(), ok=True, ranks=2):
    records = [{"ok": ok, "checkpoints": list(events)} for _ in range(ranks)]
    return rehearse.Run(name, 0 if ok else 1, Path(f"/w/{name}.log"), dict(losses), records, 1.0)


def _straight(at=2, n=5):
    losses = {i: 5.0 - 0.1 * i for i in range(1, n + 1)}
    saved = [{"op": "save", "iteration": at, "digest": DIGEST}]
    return {"stock": _run("stock", losses, saved), "flat": _run("flat", losses, saved)}


def _resumed(straight, at=2, digest=DIGEST, shift=None):
    runs = []
    for name in ("stock-to-flat", "flat-to-stock"):
        losses = {i: v for i, v in straight["stock"].losses.items() if i > at}
        if shift:
            it, factor = shift
            losses[it] *= factor
        runs.append(_run(name, losses, [{"op": "load", "iteration": at, "digest": digest}]))
    return runs


# ---------------------------------------------------------------------------- verdicts
def test_both_crossings_hold():
    straight = _straight()
    assert rehearse.crossing_verdict(straight, _resumed(straight), 2, 1e-5) is None


def test_the_loss_table_marks_the_averaged_iteration():
    straight = _straight()
    resumed = _resumed(straight, shift=(4, 1.01))
    table = rehearse.loss_table(straight["stock"], straight["flat"], resumed, skipped=4)
    assert table[0].split(" | ")[1:5] == ["stock lm loss", "flat lm loss",
                                          "stock-to-flat lm loss", "flat-to-stock lm loss"]
    row4 = table[4]
    assert row4.count("*") == 2 and row4.endswith("0.0e+00")  # not in the difference
    assert table[5].endswith("0.0e+00") and table[-1].startswith("* the mean of iterations 3")


def test_a_resumed_loss_that_differs_is_reported():
    straight = _straight()
    failed = rehearse.crossing_verdict(straight, _resumed(straight, shift=(5, 1.001)), 2, 1e-5)
    assert failed.startswith("rehearsal: the stock-to-flat run's loss differs from stock at "
                             "iteration 5"), failed


def test_the_second_logged_iteration_of_a_resumed_run_is_not_compared():
    """Megatron-LM's first log line after a start keeps its running loss sum, so the second
    averages two iterations (I+1 and I+2): that value is not a loss to compare."""
    straight = _straight()
    assert rehearse.crossing_verdict(straight, _resumed(straight, shift=(4, 1.01)), 2,
                                     1e-5) is None
    assert rehearse.crossing_verdict(straight, _resumed(straight, shift=(3, 1.01)), 2,
                                     1e-5) is not None


def test_an_optimizer_state_that_did_not_cross_is_reported():
    straight = _straight()
    changed = {**DIGEST, "exp_avg_sq": "z"}
    failed = rehearse.crossing_verdict(straight, _resumed(straight, digest=changed), 2, 1e-5)
    assert failed == ("rehearsal: the optimizer state did not cross stock-to-flat at "
                      "iteration 2: exp_avg_sq differ on rank 0")


def test_a_crossing_without_recorded_state_is_not_taken_on_trust():
    straight = _straight()
    straight["stock"] = _run("stock", straight["stock"].losses)  # no save recorded
    failed = rehearse.crossing_verdict(straight, _resumed(straight), 2, 1e-5)
    assert failed.startswith("rehearsal: no optimizer state recorded for the stock-to-flat "
                             "crossing at iteration 2 (saved on 0, loaded on 2 of 2 ranks)")


def test_a_resumed_run_that_restarted_from_scratch_is_reported():
    straight = _straight()
    resumed = _resumed(straight)
    resumed[1] = _run("flat-to-stock", straight["stock"].losses,
                      [{"op": "load", "iteration": 2, "digest": DIGEST}])
    failed = rehearse.crossing_verdict(straight, resumed, 2, 1e-5)
    assert "the flat-to-stock run logged iterations [1, 2, 3, 4, 5], not [3, 4, 5]" in failed


def test_runs_are_long_enough_and_lines_that_cannot_cross_are_refused():
    assert rehearse.resume_iters(3, 2) == 5 and rehearse.resume_iters(9, 2) == 9
    crossing = rehearse.Crossing(2, Path("/w/ck"))
    lines = rehearse.Lines(["--a"], ["--a", "--flat-sco"])
    assert crossing.runs(lines) == [
        ("stock", ["--a", "--save", "/w/ck/stock", "--save-interval", "2"]),
        ("flat", ["--a", "--flat-sco", "--save", "/w/ck/flat", "--save-interval", "2"]),
        ("stock-to-flat", ["--a", "--flat-sco", "--load", "/w/ck/stock", "--ckpt-step", "2"]),
        ("flat-to-stock", ["--a", "--load", "/w/ck/flat", "--ckpt-step", "2"])]
    with pytest.raises(rehearse.RehearsalError, match="the line has --no-load-optim"):
        rehearse.check_resumable(["--lr", "1", "--no-load-optim"], None)
    with pytest.raises(rehearse.RehearsalError, match="does not have"):
        rehearse.check_resumable(["--lr", "1"], {"--lr": 1})
    rehearse.check_resumable(["--lr", "1"], {"--lr": 1, "--ckpt-step": 1})
    lines = rehearse.launch_lines(["--save", "/u", "--save-interval", "7", "--ckpt-step", "3",
                                   "--load", "/u"], iters=3, host_budget_gib=1)
    assert "/u" not in lines.stock and "--save-interval" not in lines.flat
    assert "--hidden-dropout" not in lines.stock  # only runs that load lose hidden dropout
    resumed = rehearse.launch_lines(["--lr", "1"], iters=5, host_budget_gib=1, resume=True)
    for args in (resumed.stock, resumed.flat):
        assert args[-2:] == ["--hidden-dropout", "0"]
    assert any(n.startswith("added to every run: --hidden-dropout 0") for n in resumed.notes)
    kept = rehearse.launch_lines(["--hidden-dropout", "0.0"], iters=5, host_budget_gib=1,
                                 resume=True)
    assert kept.stock.count("--hidden-dropout") == 1


@pytest.mark.parametrize("bad", [["--resume-at", "0"], ["--resume-at", "2", "--iters", "0"]])
def test_bad_resume_options_are_refused_before_anything_runs(tmp_path, bad, capsys):
    script = checkout.write_checkout(tmp_path / "mlm", "0.16")
    assert rehearse.main([*bad, "--", str(script), "--num-layers", "2"]) == rehearse.EXIT_USAGE
    assert "--resume-at" in capsys.readouterr().err


# ---------------------------------------------------------------------------- cpu_resume
def test_initial_state_is_what_adamw_makes_at_its_first_step():
    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True) for _ in range(2)]
    twins = [p.detach().clone().requires_grad_() for p in params]
    lazy, early = torch.optim.AdamW(params, lr=0.1), torch.optim.AdamW(twins, lr=0.1)
    cpu_resume.initial_state(early)
    for _ in range(3):
        for ps in (params, twins):
            for i, p in enumerate(ps):
                p.grad = torch.full_like(p, 0.5 + i)
        lazy.step()
        early.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twins))
    assert cpu_resume.optimizer_digest(lazy) == cpu_resume.optimizer_digest(early)
    early.state[twins[1]]["exp_avg"][0, 0] += 1e-7  # one element of one moment
    changed = cpu_resume.optimizer_digest(early)
    assert {k for k in changed if changed[k] != cpu_resume.optimizer_digest(lazy)[k]} == \
        {"exp_avg"}


def test_saved_step_reads_the_distributed_optimizers_param_groups():
    assert cpu_resume.saved_step({"optimizer": {"param_groups": [{"step": 4}, {"step": 4}]}}) \
        == 4.0
    assert cpu_resume.saved_step({"optimizer": {"param_groups": [{"step": 4}, {"step": 5}]}}) \
        is None
    assert cpu_resume.saved_step({}) is None


# ---------------------------------------------------------------------------- rehearsals
def _resume(tmp_path, era, line, nproc=2):
    script = checkout.write_checkout(tmp_path / "mlm", era)
    return _rehearse(tmp_path, script, line, nproc=nproc, options=("--resume-at", "2"))


def _events(work, run):
    return [json.loads(p.read_text())["checkpoints"] for p in sorted((work / run).glob("rank*"))]


# The distributed optimizer's crossing is rehearsed on the production line with grouped
# experts, in the installed megatron-core's call shape (test_rehearse_resume_grouped.py:
# 0.16's in CI's first stage, 0.19's in its second). This one is also 0.16's call-shape
# rehearsal (test_rehearse.check_call_shape_run).
@pytest.mark.rehearsal(runs=4)  # stock, flat and a crossing each way
def test_checkpoints_cross_both_ways_without_the_distributed_optimizer(tmp_path):
    line = list(checkout.LINE) + checkout.FLAT
    line.remove("--use-distributed-optimizer")
    script = checkout.write_checkout(tmp_path / "mlm", "0.16")
    before = script.read_bytes()
    done, work = _rehearse(tmp_path, script, line, nproc=2, options=("--resume-at", "2"))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert out.splitlines()[-1] == ("rehearsal: flat losses equal stock over 5 iterations; "
                                    "checkpoints cross both ways at iteration 2")
    assert "--resume-at 2: 5 iterations per run" in out
    assert "OffloadStreamAdamW: 2 inner optimizer(s)" in out
    rows = [r for r in out.splitlines() if r.strip()[:1].isdigit()]
    assert [r.split("|")[0].strip() for r in rows] == ["1", "2", "3", "4", "5"]
    assert all(r.count(" - ") == 2 for r in rows[:2]) and all(" - " not in r for r in rows[2:])
    assert rows[3].count("*") == 2 and "* the mean of iterations 3 and 4" in out
    for saver, loader in (("stock", "stock-to-flat"), ("flat", "flat-to-stock")):
        saved = [[e for e in ev if e["op"] == "save" and e["iteration"] == 2] for ev in
                 _events(work, saver)]
        loaded = [[e for e in ev if e["op"] == "load"] for ev in _events(work, loader)]
        assert len(saved) == len(loaded) == 2
        assert [s[0]["digest"] for s in saved] == [l[0]["digest"] for l in loaded]
    assert (work / "checkpoints" / "stock" / "iter_0000002").is_dir()
    assert "/nonexistent/ckpt" not in (work / "flat.log").read_text()
    check_call_shape_run(out, work, script, before)  # 0.16's call shape, rehearsed


@pytest.mark.rehearsal(runs=4)  # stock, flat and a crossing each way
def test_a_lossy_crossing_is_caught(tmp_path):
    """The flat run's load scales the loaded first moments by 1 + 1e-6: the losses stay
    within tolerance, the optimizer state does not."""
    # One rank (EP 1): the check is per rank, and rank 0's loaded state is the perturbed one.
    line = list(checkout.LINE) + checkout.FLAT + ["--perturb-loaded-state", "1e-6"]
    line[line.index("--expert-model-parallel-size") + 1] = "1"
    done, _ = _resume(tmp_path, "0.16", line, nproc=1)
    assert done.returncode == 1, done.stdout
    assert done.stdout.splitlines()[-1] == (
        "rehearsal: the optimizer state did not cross stock-to-flat at iteration 2: exp_avg "
        "differ on rank 0")
