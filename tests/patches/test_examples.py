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
