"""``python -m megatron_flat rehearse``: launch lines, loss parsing, verdicts, and real
rehearsals of the synthetic checkout (``rehearsal_checkout``) in both call shapes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_flat.rehearse import command as rehearse
from megatron_flat.megatron import entry

sys.path.insert(0, str(Path(__file__).parent))
import rehearsal_checkout as checkout  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- launch lines
def test_strip_options_removes_flat_flags_with_their_values():
    arities = rehearse._flat_arities()
    line = ["--num-layers", "2", "--flat-dispatch", "pipelined", "--flat-sco",
            "--flat-dispatch-chunk-tokens=8", "--no-flat-vocab", "--lr", "0.1",
            "--flat-preset", "paper"]
    kept, removed = rehearse.strip_options(line, arities)
    assert kept == ["--num-layers", "2", "--lr", "0.1"]
    assert removed == ["--flat-dispatch", "pipelined", "--flat-sco",
                       "--flat-dispatch-chunk-tokens=8", "--no-flat-vocab", "--flat-preset",
                       "paper"]


def test_launch_lines_override_drop_and_cap():
    lines = rehearse.launch_lines(checkout.LINE + checkout.FLAT, iters=4, host_budget_gib=0.5)
    for args in (lines.stock, lines.flat):
        assert "--save" not in args and "/nonexistent/ckpt" not in args
        # argparse keeps the last value: the overrides come after the user's own.
        assert args[len(args) - 1 - args[::-1].index("--distributed-backend") + 1] == "gloo"
        assert args[len(args) - 1 - args[::-1].index("--log-interval") + 1] == "1"
        assert args[args.index("--train-iters") + 1] == "4"
    assert not [a for a in lines.stock if "flat-" in a]
    assert lines.flat[-2:] == ["--flat-sco-host-budget-gib", "0.5"]  # paper: 64 GiB
    assert lines.flat_config.sco_host_budget_gib == 0.5
    assert any("64 GiB -> 0.5 GiB" in n for n in lines.notes)


def test_launch_lines_leave_a_small_budget_and_the_iterations_alone():
    line = checkout.LINE + ["--flat-sco", "--flat-sco-host-budget-gib", "0.25"]
    lines = rehearse.launch_lines(line, iters=0, host_budget_gib=1.0)
    assert "--train-iters" not in lines.flat
    assert lines.flat_config.sco_host_budget_gib == 0.25
    assert not any("capped" in n for n in lines.notes)


def test_launch_lines_turn_attention_dropout_off_under_context_parallelism():
    """The CPU backend's CP core attention has no dropout: a CP line without
    --attention-dropout (Megatron-LM's default is 0.1) or with a non-zero one gets 0 in both
    runs, said in the notes; without CP, or with dropout already 0, nothing is added."""
    for extra in ([], ["--attention-dropout", "0.1"], ["--attention-dropout=0.2"]):
        line = checkout.LINE + ["--context-parallel-size", "2"] + extra + checkout.FLAT
        lines = rehearse.launch_lines(line, iters=3, host_budget_gib=1.0)
        for args in (lines.stock, lines.flat):
            last = len(args) - 1 - args[::-1].index("--attention-dropout")
            assert args[last + 1] == "0"
        assert any("--attention-dropout 0 (the CPU backend's context-parallel attention"
                   in n for n in lines.notes)
    for line in (checkout.LINE + checkout.FLAT,
                 checkout.LINE + ["--context-parallel-size", "2", "--attention-dropout", "0.0"],
                 checkout.LINE + ["--context-parallel-size=1"]):
        lines = rehearse.launch_lines(line, iters=3, host_budget_gib=1.0)
        assert lines.stock.count("--attention-dropout") == line.count("--attention-dropout")
        assert not any("attention-dropout" in n for n in lines.notes)


def test_bad_flat_flags_are_refused_before_launch(tmp_path, capsys):
    script = checkout.write_checkout(tmp_path / "mlm", "0.16")
    code = rehearse.main(["--", str(script), "--flat-dispatch", "sideways"])
    assert code == rehearse.EXIT_USAGE
    assert "--flat-dispatch" in capsys.readouterr().err


def test_usage_errors(tmp_path, capsys):
    assert rehearse.main(["--", str(tmp_path / "missing.py")]) == rehearse.EXIT_USAGE
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        rehearse.main(["--nproc-per-node", "2"])  # no launch line
    assert exc.value.code == 2
    script = checkout.write_checkout(tmp_path / "mlm", "0.16")
    assert rehearse.main(["--nproc-per-node", "0", "--", str(script)]) == rehearse.EXIT_USAGE


def test_a_partly_patched_script_is_refused(tmp_path, capsys):
    script = checkout.write_checkout(tmp_path / "mlm", "0.16")
    text = script.read_text()
    script.write_text(text.replace("store=store,\n", "store=store,  # megatron-flat\n"))
    assert rehearse.main(["--", str(script)]) == rehearse.EXIT_USAGE
    assert "patch" in capsys.readouterr().err


# ---------------------------------------------------------------------------- logs, verdict
MEGATRON_LOG = (
    " [2026-12-01 20:38:38.699852] iteration        1/       3 | consumed samples:            4"
    " | elapsed time per iteration (ms): 284.1 | learning rate: 6.666667E-04 | global batch "
    "size:     4 | lm loss: 5.549661E+00 | loss scale: 1.0 | grad norm: 1.097 |\n"
    "[rank1]: something else | lm loss: 9.0E+00 |\n"
    " [2026-12-01 20:38:38.806315] iteration        2/       3 | consumed samples:            8"
    " | lm loss: 5.502558E+00 | mtp_1 loss: 5.7E+00 |\n"
    " [2026-12-01 20:38:38.806315] iteration        2/       3 | lm loss: 7.0E+00 |\n")


def test_parse_losses_reads_megatron_lines_first_per_iteration():
    assert rehearse.parse_losses(MEGATRON_LOG) == {1: 5.549661, 2: 5.502558}


def _run(name, losses, ok=True, modules=None):
    rank = {"ok": ok, "sections": {}, "run_peak": [0, 0],
            "modules": modules or {"FlatMoELayer": 0, "MoELayer": 2}, "flat": {}}
    return rehearse.Run(name, 0 if ok else 1, Path(f"/tmp/{name}.log"), losses, [rank], 1.0)


def test_verdict():
    stock = _run("stock", {1: 5.0, 2: 4.9})
    code, last = rehearse.verdict(stock, _run("flat", {1: 5.0, 2: 4.9}), 1e-5)
    assert code == 0 and last == "rehearsal: flat losses equal stock over 2 iterations"
    code, last = rehearse.verdict(stock, _run("flat", {1: 5.0, 2: 4.95}), 1e-5)
    assert code == 1 and "differs from stock at iteration 2" in last
    assert rehearse.verdict(stock, _run("flat", {1: 5.0, 2: 4.9 * (1 + 1e-6)}), 1e-5)[0] == 0
    code, last = rehearse.verdict(stock, _run("flat", {1: 5.0}), 1e-5)
    assert code == 1 and "different iterations" in last
    code, last = rehearse.verdict(stock, _run("flat", {1: 5.0, 2: float("nan")}), 1e-5)
    assert code == 1
    code, last = rehearse.verdict(stock, _run("flat", {}, ok=False), 1e-5)
    assert code == 1 and "the flat run failed" in last
    code, last = rehearse.verdict(stock, _run("flat", {}), 1e-5)
    assert code == 1 and "no 'lm loss' lines" in last
    flat_in_stock = _run("stock", {1: 5.0, 2: 4.9}, modules={"FlatMoELayer": 2, "MoELayer": 2})
    code, last = rehearse.verdict(flat_in_stock, _run("flat", {1: 5.0, 2: 4.9}), 1e-5)
    assert code == 1 and "stock run built 2 FlatMoELayer" in last


def test_verdict_when_dispatch_was_asked_for_but_not_built():
    flat = _run("flat", {1: 5.0})
    flat.ranks[0]["flat"] = {"dispatch": "pipelined"}
    code, last = rehearse.verdict(_run("stock", {1: 5.0}), flat, 1e-5)
    assert code == 1 and "no MoE layer is a FlatMoELayer" in last


def test_attention_tiles_are_reported_and_missing_ones_fail():
    modules = {"FlatMoELayer": 0, "MoELayer": 2, "layers": 2, "tiled_layers": 2,
               "attention_tiles_used": 3}
    flat = _run("flat", {1: 5.0}, modules=modules)
    flat.ranks[0]["flat"] = {"attn_tiles": 6}
    assert rehearse.what_ran(flat) == [
        "attention tiles: tiled QKV and output projections in 2 of 2 layers, up to 3 tile(s) "
        "per projection"]
    modules["attention_tiles_used"] = 1
    assert rehearse.what_ran(flat)[0].endswith("(the tile holds the whole rehearsal sequence)")
    assert rehearse.verdict(_run("stock", {1: 5.0}), flat, 1e-5)[0] == 0
    modules["tiled_layers"] = 0
    code, last = rehearse.verdict(_run("stock", {1: 5.0}), flat, 1e-5)
    assert code == 1 and "--flat-attn-tiles 6 is on but no layer has the tiled" in last


def test_attention_replay_is_reported_served_or_fallen_back():
    modules = {"layers": 2, "replay_capable_attentions": 2, "attention_replays": 8}
    flat = _run("flat", {1: 5.0}, modules=modules)
    flat.ranks[0]["flat"] = {"attn_replay": True}
    assert rehearse.what_ran(flat) == ["attention replay: 8 re-run(s) served without the kernel"]
    modules.update(replay_capable_attentions=0, attention_replays=0)
    assert rehearse.what_ran(flat)[0].startswith(
        "attention replay: fell back to the stock recompute (0 core attention(s) can replay")
    # a fallback is what replay promises where it cannot be exact: the verdict stands
    assert rehearse.verdict(_run("stock", {1: 5.0}), flat, 1e-5)[0] == 0


def test_first_error_skips_torchrun_noise():
    log = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
           "[rank0]: RuntimeError: boom\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert rehearse.first_error(log) == "RuntimeError: boom"
    assert rehearse.first_error("all good\n") is None
    bare = ("  File \"s.py\", line 157, in __init__\n    assert warmup < decay\n"
            "           ^^^^^^^^^^^^^^\nAssertionError\n")
    assert rehearse.first_error(bare) == (
        "AssertionError (assert warmup < decay), raised in __init__ (s.py:157)")


def _torchrun_failure(ranks):
    """torchrun's closing report for ``ranks`` ``[(rank, exitcode, traceback line)]``, the
    last of them its root cause."""
    def block(i, rank, code, trace):
        return (f"[{i}]:\n  time      : 2026-12-05_23:07:26\n  host      : localhost\n"
                f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: 4{rank})"
                f"\n  error_file: <N/A>\n  traceback : {trace}\n")
    *others, root = ranks
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
            "Failures:\n" + "".join(block(i + 1, *r) for i, r in enumerate(others))
            + "Root Cause (first observed failure):\n" + block(0, *root))


def test_first_error_names_a_killed_rank_before_its_peers_errors():
    """A rank killed by SIGKILL is the cause even when a peer logged its consequence (a closed
    connection) first and torchrun calls that peer the root cause, as it does under load; a
    rank ended by torchrun's SIGTERM is not a cause."""
    killed = ("[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:29500\n"
              + _torchrun_failure([(1, -9, "Signal 9 (SIGKILL) received by PID 41"),
                                   (0, 1, "To enable traceback see: https://pytorch.org")]))
    assert rehearse.first_error(killed) == "rank 1: Signal 9 (SIGKILL) received by PID 41"
    raised = ("[rank0]: ValueError: bad shape\n"
              + _torchrun_failure([(1, -15, "Signal 15 (SIGTERM) received by PID 41"),
                                   (0, 1, "To enable traceback see: https://pytorch.org")]))
    assert rehearse.first_error(raised) == "ValueError: bad shape"


# ---------------------------------------------------------------------------- --help
def test_help_requested():
    assert entry.help_requested(["p.py", "--num-layers", "2", "-h"])
    assert entry.help_requested(["p.py", "--help"])
    assert not entry.help_requested(["p.py", "--", "--help"])
    assert not entry.help_requested(["p.py", "--num-layers", "2"])


def test_escape_lone_percents():
    text = "10%). 100%% sure, default %(default)s"
    escaped = entry._escape_lone_percents(text)
    assert escaped % {"default": 3} == "10%). 100% sure, default 3"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@pytest.mark.rehearsal
@pytest.mark.parametrize("era", ["0.16", "0.19"])
def test_help_of_a_patched_script_lists_the_flat_flags(tmp_path, era):
    """Megatron-LM's first parse (inprocess restart's, stock parser) answers --help."""
    script = checkout.write_checkout(tmp_path / "mlm", era)
    patched = subprocess.run([sys.executable, "-m", "megatron_flat", "patch", str(script.parent)],
                             capture_output=True, text=True, env=_env())
    assert patched.returncode == 0, patched.stdout + patched.stderr
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                           text=True, env=_env(), cwd=script.parent)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "--flat-dispatch {off,llep,pipelined}" in shown.stdout
    assert "PipelinedLLEP" in shown.stdout and "--flat-sco-host-budget-gib" in shown.stdout
    assert "100% synthetic" in shown.stdout  # the checkout's own unescaped "%" survives
    unpatched = checkout.write_checkout(tmp_path / "plain", era)
    stock = subprocess.run([sys.executable, str(unpatched), "--help"], capture_output=True,
                           text=True, env=_env(), cwd=unpatched.parent)
    assert "--flat-" not in stock.stdout  # only a patched script knows them


# ---------------------------------------------------------------------------- rehearsals
def _rehearse(tmp_path, script, line, nproc, options=()):
    work = tmp_path / "work"
    done = subprocess.run(
        [sys.executable, "-m", "megatron_flat", "rehearse", "--nproc-per-node", str(nproc),
         *options, "--work-dir", str(work), "--timeout", "600", "--", str(script), *line],
        capture_output=True, text=True, env=_env(), cwd=tmp_path)
    return done, work


# 0.16's call shape is rehearsed with its checkpoints crossing (test_rehearse_resume.py's
# test_checkpoints_cross_both_ways_without_the_distributed_optimizer, with
# check_call_shape_run) and with the production line
# (test_rehearse_resume_grouped.py, CI's first stage).
@pytest.mark.rehearsal
def test_rehearsal_of_the_0_19_call_shape_finds_flat_equal_to_stock(tmp_path):
    script = checkout.write_checkout(tmp_path / "mlm", "0.19")
    before = script.read_bytes()
    done, work = _rehearse(tmp_path, script, checkout.LINE + checkout.FLAT, nproc=2)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert out.splitlines()[-1] == "rehearsal: flat losses equal stock over 3 iterations"
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3 and all(line.endswith("0.0e+00") for line in rows)  # side by side
    assert "dropped (a rehearsal writes nothing): --save /nonexistent/ckpt" in out
    check_call_shape_run(out, work, script, before)


def check_call_shape_run(out: str, work, script, before: bytes) -> None:
    """The checkout's line ran with every technique on, the memory table printed, the
    script patched in memory only, and every rank recorded."""
    assert "FlatMoELayer in 2 of 2 MoE layers" in out and "Ring-DTP: on" in out
    assert "OffloadStreamAdamW: 2 inner optimizer(s)" in out
    for row in ("expert dispatch |", "checkpoint boundaries |", "optimizer step |",
                "whole run |"):
        assert row in out
    assert script.read_bytes() == before  # patched in memory only
    for name in ("stock", "flat"):
        assert len(list((work / name).glob("rank*.json"))) == 2


@pytest.mark.rehearsal
def test_rehearsal_of_a_context_parallel_line_finds_flat_equal_to_stock(tmp_path):
    """CP 2 x EP 2 on 2 ranks: the CPU backend builds its CP core attention in both runs and
    says so; every technique under CP still equals stock."""
    script = checkout.write_checkout(tmp_path / "mlm", "0.19")
    line = list(checkout.LINE) + ["--context-parallel-size", "2"]
    done, work = _rehearse(tmp_path, script, line + checkout.FLAT, nproc=2)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert out.splitlines()[-1] == "rehearsal: flat losses equal stock over 3 iterations"
    assert ("core attention under context parallelism: the CPU backend's "
            "ContextParallelCoreAttention") in out
    assert "in 2 stock and 2 flat layer(s) per rank" in out
    assert "FlatMoELayer in 2 of 2 MoE layers" in out and "Ring-DTP: on" in out
    assert "OffloadStreamAdamW: 2 inner optimizer(s)" in out
    offloaded = re.search(r"SCO: (\d+) of (\d+) boundaries offloaded", out)
    assert offloaded and int(offloaded.group(1)) > 0, out


@pytest.mark.rehearsal
def test_rehearsal_of_a_deepseek_style_line_builds_stocks_model(tmp_path):
    """A first dense layer and q/k norms (``--moe-layer-freq '([0]*1+[1]*1)' --qk-layernorm``)
    with the flat spec: the flat run builds Megatron's own spec for the line (the stock run has
    no --spec at all), the report prints both parameter counts, and they are equal."""
    script = checkout.write_checkout(tmp_path / "mlm", "0.16")
    line = list(checkout.LINE) + ["--moe-layer-freq", "([0]*1+[1]*1)", "--qk-layernorm"]
    done, work = _rehearse(tmp_path, script, line + checkout.FLAT, nproc=2)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert out.splitlines()[-1] == "rehearsal: flat losses equal stock over 3 iterations"
    assert ("stock run: without --spec megatron_flat.megatron.spec flat_gpt_layer_spec"
            in out.replace("--flat-preset paper --flat-dispatch-chunk-tokens 4 "
                           "--flat-optimizer-bucket-numel 4096 ", ""))
    assert "FlatMoELayer in 1 of 1 MoE layers" in out
    counts = re.search(r"parameters: stock ([\d,]+), flat ([\d,]+) \(over 2 rank", out)
    assert counts and counts.group(1) == counts.group(2), out
    import json

    ranks = [json.loads((work / "flat" / f"rank{r}.json").read_text()) for r in (0, 1)]
    names = [name for _, name, _, _ in ranks[0]["parameters"]]
    assert any("q_layernorm" in n for n in names) and any("linear_fc1" in n for n in names)


# The smoke rehearsal (FLAT_REHEARSALS=smoke, CI's second megatron-core version): the family
# line that reaches the most code (MLA, dense first layer, MTP, sigmoid group-limited router,
# overlapped shared expert); the in-process family tests run in full on both versions.
# GPT-OSS's line (transformer-engine, grouped GEMM) is rehearsed with its checkpoints crossing
# at EP 2 x expert DP 2 (test_rehearse_resume_grouped.py), with the same checks.
FAMILY_REHEARSALS = [pytest.param("deepseek_v3", marks=pytest.mark.rehearsal(smoke=True)),
                     "kimi_k2", "qwen3_moe", "qwen2_moe", "mixtral", "llama4"]


def _family_line(family: str) -> list:
    """The family's rehearsal line: the checkout's CPU line, except GPT-OSS's as it is
    trained, transformer-engine with grouped GEMM (its experts: TEGroupedMLP with biases)."""
    line = list(checkout.LINE)
    if family == "gpt_oss":
        line[line.index("--transformer-impl") + 1] = "transformer_engine"
        line[line.index("flat_gpt_layer_spec")] = "flat_gpt_layer_te_spec"
        line.append("--moe-grouped-gemm")
    return line


@pytest.mark.rehearsal
@pytest.mark.parametrize("family", FAMILY_REHEARSALS)
def test_rehearsal_of_each_family_line_finds_flat_equal_to_stock(tmp_path, family):
    """Each MoE family's architecture (``testing.families``; the synthetic checkout builds it as
    Megatron-LM's GPT builder does) with every technique of --flat-preset paper on, EP 2 over
    2 ranks, full recompute, the distributed optimizer: the same parameters, flat losses equal
    stock, every technique in the model."""
    script = checkout.write_checkout(tmp_path / "mlm", "0.19")
    done, work = _rehearse(tmp_path, script, _family_line(family) + checkout.FLAT
                           + ["--family", family], nproc=2)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "rehearsal: flat losses equal stock over 3 iterations"
    check_family_run(done.stdout, work, family, nproc=2)


def check_family_run(out: str, work, family: str, nproc: int) -> None:
    """A family line's rehearsal ran the same model both ways with every technique in it."""
    if family == "gpt_oss":  # the experts the GPU line builds, with their biases
        import json

        rank = json.loads((work / "flat" / "rank0.json").read_text())
        names = [name for _, name, _, _ in rank["parameters"]]
        assert any(n.endswith("experts.linear_fc2.bias0") for n in names), names
        assert any(n.endswith("core_attention.softmax_offset") for n in names), names
    counts = re.search(rf"parameters: stock ([\d,]+), flat ([\d,]+) \(over {nproc} rank", out)
    assert counts and counts.group(1) == counts.group(2), out
    moe = re.search(r"FlatMoELayer in (\d+) of (\d+) MoE layers", out)
    assert moe and moe.group(1) == moe.group(2) != "0", out
    assert "Ring-DTP: on" in out and "OffloadStreamAdamW: 2 inner optimizer(s)" in out
    offloaded = re.search(r"SCO: (\d+) of (\d+) boundaries offloaded", out)
    assert offloaded and int(offloaded.group(1)) > 0, out


@pytest.mark.rehearsal
def test_rehearsal_fails_a_flat_model_that_drops_a_qk_norm(tmp_path):
    """Negative control: a flat spec that loses the q/k norms fails on parameters, before and
    whatever the losses say."""
    script = checkout.write_checkout(tmp_path / "mlm", "0.19")
    line = list(checkout.LINE) + ["--qk-layernorm"]
    line[line.index("--expert-model-parallel-size") + 1] = "1"
    done, _ = _rehearse(tmp_path, script, line + ["--flat-dispatch", "pipelined",
                                                  "--drop-qk-norm-when-flat"], nproc=1)
    assert done.returncode == 1, done.stdout
    last = done.stdout.splitlines()[-1]
    assert last.startswith("rehearsal: the flat model is not the stock model (parameters: "
                           "stock "), last
    assert "q_layernorm" in last, last


@pytest.mark.rehearsal
def test_rehearsal_catches_a_loss_difference(tmp_path):
    script = checkout.write_checkout(tmp_path / "mlm", "0.19")
    line = list(checkout.LINE)
    line[line.index("--expert-model-parallel-size") + 1] = "1"
    done, _ = _rehearse(tmp_path, script,
                        line + ["--flat-dispatch", "pipelined", "--perturb-flat-lr", "0.5"],
                        nproc=1)
    assert done.returncode == 1, done.stdout
    last = done.stdout.splitlines()[-1]
    # Iteration 1 runs before any update: equal; the larger learning rate shows at 2.
    assert last.startswith("rehearsal: flat loss differs from stock at iteration 2"), last


@pytest.mark.rehearsal
def test_rehearsal_reports_a_failed_run(tmp_path):
    script = checkout.write_checkout(tmp_path / "mlm", "0.16")
    line = list(checkout.LINE)
    line[line.index("--expert-model-parallel-size") + 1] = "1"
    # A line written for the CPU passes --strict's check (test_strict_refuses_... is the
    # line that does not); one iteration is enough for the failure.
    done, work = _rehearse(tmp_path, script,
                           line + ["--flat-dispatch", "pipelined", "--fail-when-flat"], nproc=1,
                           options=("--strict", "--iters", "1"))
    assert done.returncode == 1
    assert "--strict" not in done.stderr and (work / "stock.log").exists()
    assert "the flat run's first error: RuntimeError: synthetic failure in the flat run" \
        in done.stdout
    assert done.stdout.splitlines()[-1] == (
        f"rehearsal: the flat run failed (exit 1); its log: {work / 'flat.log'}")


# ---------------------------------------------------------------------------- a GPU line
SUBSTITUTED = (
    "[substituted] --transformer-impl transformer_engine (Megatron-LM's default) -> "
    "--transformer-impl local",
    "[substituted] --spec megatron_flat.megatron.spec flat_gpt_layer_te_spec -> "
    "--spec megatron_flat.megatron.spec flat_gpt_layer_spec",
    "[substituted] the fused RoPE kernel (Megatron-LM's default) -> --no-rope-fusion",
    "[substituted] apex's persistent layer-norm kernel (Megatron-LM's default) -> "
    "--no-persist-layer-norm",
    "[substituted] apex's fused weight-gradient accumulation into main_grad (Megatron-LM's "
    "default) -> --no-gradient-accumulation-fusion",
    "[substituted] Megatron's fused scale-mask-softmax kernel (Megatron-LM's default) -> "
    "--no-masked-softmax-fusion",
    "[substituted] the fused bias-SwiGLU kernel (Megatron-LM's default) -> "
    "--no-bias-swiglu-fusion",
    "[substituted] the fused bias-dropout-add kernel (Megatron-LM's default) -> "
    "--no-bias-dropout-fusion",
    "[substituted] --moe-grouped-gemm -> --moe-grouped-gemm, Megatron-LM's compute-capability "
    "check answered on CPU; TEGroupedMLP with CPU grouped linears for TE's",
    "[dropped] --cuda-graph-impl local --cuda-graph-scope attn moe -> (dropped)",
    "[dropped] --tp-comm-overlap -> (dropped)",
)


def _era_of_installed_core() -> str:
    """The call shape that goes with the installed megatron-core (each CI stage runs one; the
    two stages together run both)."""
    import importlib.metadata

    version = importlib.metadata.version("megatron-core")
    return "0.16" if version.startswith("0.16") else "0.19"


# The production line is rehearsed with its grouped experts' checkpoints crossing
# (test_rehearse_resume_grouped.py, both megatron-core versions), with these checks.
def check_production_run(out: str, work) -> None:
    """The line a GPU job script has (transformer-engine by default, fused kernels, the
    transformer-engine layer spec, grouped GEMM, bf16, CUDA graphs, userbuffer overlap): every
    GPU-only setting is announced with its CPU form, and the runs then equal."""
    block = out[out.index("11 setting(s) of the line run otherwise on CPU"):
                out.index("stock run ...")]
    for change in SUBSTITUTED:
        assert f"  {change}: " in block, change
    assert len([l for l in block.splitlines() if l.startswith("  [")]) == len(SUBSTITUTED)
    assert "loss tolerance: relative 9.8e-04 (a quarter of bf16's unit roundoff" in out
    stock_log = (work / "stock.log").read_text()
    assert "--transformer-impl local" in stock_log and "--tp-comm-overlap" not in stock_log


@pytest.mark.rehearsal
def test_the_production_line_fails_without_its_substitutions(tmp_path):
    """The negative control: each obstacle is real (the synthetic checkout refuses a GPU-only
    setting still on), so the substitutions above are what made the runs pass."""
    script = checkout.write_checkout(tmp_path / "mlm", "0.19")
    env = _env()
    env["MEGATRON_FLAT_REHEARSAL_OUT"] = str(tmp_path / "out")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "-m", rehearse.WORKER, str(script), *checkout.PRODUCTION, "--train-iters", "1",
         "--distributed-backend", "gloo", "--expert-model-parallel-size", "1"],
        capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode != 0
    assert "synthetic GPU-only setting transformer_impl" in done.stdout + done.stderr


def test_strict_refuses_a_production_line_before_launching(tmp_path):
    script = checkout.write_checkout(tmp_path / "mlm", "0.16")
    work = tmp_path / "work"
    done = subprocess.run(
        [sys.executable, "-m", "megatron_flat", "rehearse", "--strict", "--work-dir",
         str(work), "--", str(script), *checkout.PRODUCTION],
        capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert done.returncode == rehearse.EXIT_USAGE, done.stdout + done.stderr
    assert "error: --strict: 11 setting(s) of the line have no CPU form" in done.stderr
    assert "--tp-comm-overlap (dropped)" in done.stderr
    assert not (work / "stock.log").exists()  # nothing launched
    # a line written for the CPU passes --strict's check: test_rehearsal_reports_a_failed_run


def test_fp8_is_refused_before_launching(tmp_path):
    script = checkout.write_checkout(tmp_path / "mlm", "0.19")
    done = subprocess.run(
        [sys.executable, "-m", "megatron_flat", "rehearse", "--work-dir", str(tmp_path / "w"),
         "--", str(script), *checkout.PRODUCTION, "--fp8-format", "hybrid"],
        capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert done.returncode == rehearse.EXIT_USAGE
    assert "cannot run without changing the math" in done.stderr
    assert "--fp8-format hybrid: fp8 GEMMs round differently" in done.stderr
    assert not (tmp_path / "w" / "stock.log").exists()
