"""The example launch scripts' dry runs (DRY_RUN=1) against a patched synthetic checkout: the
command they would run, with the flags that running without transformer-engine or apex needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _dry_run(checkout: Path, **env) -> list:
    run_env = dict(os.environ, PYTHON=sys.executable, MEGATRON_LM=str(checkout), DRY_RUN="1",
                   **env)
    done = subprocess.run(["bash", str(REPO / "examples" / "pretrain_gpt_flat_single_gpu.sh")],
                          capture_output=True, text=True, env=run_env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.fixture
def patched(megatron_dir, script_019):
    path = megatron_dir(script_019)
    subprocess.run([sys.executable, str(REPO / "patches" / "apply.py"), str(path.parent)],
                   check=True, capture_output=True)
    return path.parent


def test_single_gpu_default_uses_transformer_engine(patched):
    cmd = _dry_run(patched)
    assert cmd[cmd.index("--transformer-impl") + 1] == "transformer_engine"
    assert not {"--no-rope-fusion", "--no-persist-layer-norm",
                "--no-gradient-accumulation-fusion"} & set(cmd)


def test_single_gpu_without_te_and_apex_gets_their_flags(patched):
    cmd = _dry_run(patched, TRANSFORMER_IMPL="local", NO_APEX="1")
    assert cmd[cmd.index("--transformer-impl") + 1] == "local"
    assert {"--no-rope-fusion", "--no-persist-layer-norm",
            "--no-gradient-accumulation-fusion"} <= set(cmd)


def test_single_gpu_refuses_an_unpatched_checkout(megatron_dir, script_019):
    path = megatron_dir(script_019)
    run_env = dict(os.environ, PYTHON=sys.executable, MEGATRON_LM=str(path.parent),
                   DRY_RUN="1")
    done = subprocess.run(["bash", str(REPO / "examples" / "pretrain_gpt_flat_single_gpu.sh")],
                          capture_output=True, text=True, env=run_env, cwd=REPO)
    assert done.returncode == 1 and "does not take the --flat-* flags" in done.stderr


def _run_example(name: str, checkout: Path, **env) -> list:
    run_env = dict(os.environ, PYTHON=sys.executable, MEGATRON_LM=str(checkout), DRY_RUN="1",
                   **env)
    done = subprocess.run(["bash", str(REPO / "examples" / name)], capture_output=True,
                          text=True, env=run_env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def _last(cmd: list, flag: str) -> str:
    """The value argparse keeps for ``flag``: the one given last."""
    return cmd[len(cmd) - 1 - cmd[::-1].index(flag) + 1]


@pytest.mark.parametrize("name, nproc", [("pretrain_gpt_flat_single_gpu.sh", "1")])
def test_rehearse_mode_runs_the_same_flags_at_a_tiny_shape(megatron_dir, script_019, name,
                                                           nproc):
    # REHEARSE=1 needs no patched checkout: the rehearsal patches in memory.
    checkout = megatron_dir(script_019).parent
    cmd = _run_example(name, checkout, REHEARSE="1")
    subprocess.run([sys.executable, str(REPO / "patches" / "apply.py"), str(checkout)],
                   check=True, capture_output=True)
    launch = _run_example(name, checkout, TRANSFORMER_IMPL="transformer_engine")
    assert cmd[1:6] == ["-m", "megatron_flat", "rehearse", "--nproc-per-node", nproc]
    assert cmd[6] == "--" and cmd[7] == str(checkout / "pretrain_gpt.py")
    assert "--bf16" in launch and "--bf16" not in cmd  # fp32 on CPU
    # Every launch flag is rehearsed (the tiny overrides come after and win).
    launch_flags = [a for a in launch[launch.index(str(checkout / "pretrain_gpt.py")) + 1:]
                    if a.startswith("--") and a != "--bf16"]
    assert [a for a in cmd[8:] if a.startswith("--")][:len(launch_flags)] == launch_flags
    assert _last(cmd, "--transformer-impl") == "local"
    assert _last(cmd, "--spec") == "megatron_flat.megatron.spec"
    assert cmd[len(cmd) - 1 - cmd[::-1].index("--spec") + 2] == "flat_gpt_layer_spec"
    assert _last(cmd, "--seq-length") == "64" and _last(cmd, "--vocab-size") == "128"
    assert {"--no-rope-fusion", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion"} <= set(cmd)
    assert "--flat-preset" in cmd
