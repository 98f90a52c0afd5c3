"""Patched synthetic pretrain scripts run in a subprocess: the --flat-* flags arrive through the
composed extra_args_provider, next to the existing provider's flags, and install runs once,
before the model is built. Stubs: megatron.training (global args) in ``stub_megatron``;
pretrain / parse_and_validate_args in the scripts themselves."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--flat-dispatch-max-chunks", "3", "--flat-sco-prefetch", "2",
         "--export-te-mcore-model", "--num-layers", "4"]


def run_script(stub_megatron, script, *argv):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stub_megatron), str(REPO),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(stub_megatron / "harness.py"), str(script), *argv],
                          capture_output=True, text=True, env=env, cwd=script.parent)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc


def patched(apply, path):
    rc = apply.run([str(path.parent)], out=io.StringIO())
    assert rc == 0
    return path


def check_install(event, *, export=True):
    kind, config, export_flag = event
    assert kind == "install"
    assert config["dispatch_max_chunks"] == 3 and config["sco_prefetch"] == 2
    assert export_flag is export


def test_016_patched_script_receives_flags_and_installs_before_build(
        apply, megatron_dir, script_016, stub_megatron):
    path = patched(apply, megatron_dir(script_016))
    events, _ = run_script(stub_megatron, path, *FLAGS)
    assert len(events) == 3
    check_install(events[0])
    assert events[1:] == [["build", 0, 3], ["build", 1, 3]]  # installed once, two stages


def test_019_patched_script_receives_flags_and_installs_before_build(
        apply, megatron_dir, script_019, stub_megatron):
    path = patched(apply, megatron_dir(script_019))
    events, _ = run_script(stub_megatron, path, *FLAGS)
    assert len(events) == 2
    check_install(events[0])
    assert events[1] == ["build", None, 3]


@pytest.mark.parametrize("era", ["016", "019"])
def test_unpatched_script_rejects_flat_flags(megatron_dir, stub_megatron, era, request):
    path = megatron_dir(request.getfixturevalue(f"script_{era}"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub_megatron), str(REPO)]))
    proc = subprocess.run([sys.executable, str(stub_megatron / "harness.py"), str(path), *FLAGS],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert "unrecognized arguments: --flat-dispatch-max-chunks" in proc.stderr


@pytest.mark.parametrize("era", ["016", "019"])
def test_patched_script_without_previous_provider(apply, megatron_dir, stub_megatron, era,
                                                  request):
    source = request.getfixturevalue(f"script_{era}").replace(
        "        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,\n", "")
    path = patched(apply, megatron_dir(source))
    assert "extra_args_provider=flat_extra_args()" in path.read_text()
    events, _ = run_script(stub_megatron, path, *FLAGS[:4])
    check_install(events[0], export=None)
    assert all(e[0] == "build" and e[2] == 3 for e in events[1:]) and len(events) > 1
