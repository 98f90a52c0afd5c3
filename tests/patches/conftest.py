"""Synthetic ``pretrain_gpt.py`` scripts in both Megatron-LM call shapes, and the patcher.

The scripts are written for these tests (no Megatron-LM source): the same imports, a
``try/except ImportError`` for an optional provider, an ``if __name__ == "__main__":`` block
with multi-line calls and the ``extra_args_provider=X if flag else None`` keyword. Their
``pretrain`` / ``parse_and_validate_args`` are stubs defined in the script itself, so a
patched script runs here (see ``stub_megatron``) and shows which flags arrived.
"""

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from rehearsal_checkout import GLOBAL_VARS, MAIN_016, MAIN_019  # noqa: E402  (shared)

REPO = Path(__file__).resolve().parents[2]

_COMMON = '''\
"""Synthetic pretrain script ({era} call shape)."""

import argparse
from functools import partial
from typing import Optional

from megatron.training import EVENTS, get_args, set_args

try:
    from megatron.post_training.arguments import add_modelopt_args

    has_nvidia_modelopt = True
except ImportError:
    has_nvidia_modelopt = False


def model_provider(model_builder, pre_process=True, post_process=True, vp_stage=None):
    """Build the model for one (virtual) pipeline stage."""
    EVENTS.append(["build", vp_stage, get_args().flat_dispatch_max_chunks])
    return model_builder(pre_process, post_process, vp_stage)


def gpt_builder(pre_process, post_process, vp_stage: Optional[int] = None):
    return {{"vp_stage": vp_stage}}


def forward_step(data_iterator, model):
    return None


def datasets_provider(num_samples):
    return None, None, None


def maybe_wrap_for_inprocess_restart(fn):
    return fn, None


def _parse(extra_args_provider):
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
    parser.add_argument("--num-layers", type=int, default=2)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_args()
    set_args(args)
    return args
'''

SCRIPT_016 = _COMMON.format(era="0.16-era") + '''

def pretrain(datasets_provider, model_provider, model_type, forward_step_func,
             args_defaults=None, extra_args_provider=None, store=None):
    _parse(extra_args_provider)
    for vp_stage in (0, 1):
        model_provider(pre_process=True, post_process=True, vp_stage=vp_stage)
''' + MAIN_016

SCRIPT_019 = _COMMON.format(era="0.19-era") + '''

def parse_and_validate_args(extra_args_provider=None, args_defaults={}):
    return _parse(extra_args_provider)


def pretrain(config, datasets_provider, model_type, forward_step_func, model_provider=None,
             store=None):
    EVENTS.append(["build", None, get_args().flat_dispatch_max_chunks])
''' + MAIN_019

_STUB_TRAINING = ('''\
"""Stand-in for megatron.training: the global args and an event log."""
EVENTS = []
''' + GLOBAL_VARS)

_STUB_MODELOPT = '''\
def add_modelopt_args(parser):
    parser.add_argument("--export-te-mcore-model", action="store_true")
    return parser
'''

# Runs a script as __main__ with megatron_flat.install recorded (the real install checks a
# full Megatron config, which the stubs do not have), then prints the event log as JSON.
_HARNESS = '''\
import json
import runpy
import sys

import megatron_flat
from megatron.training import EVENTS
from megatron_flat.config import FlatConfig


def record_install(args):
    EVENTS.append(["install", FlatConfig.from_args(args).to_dict(),
                   getattr(args, "export_te_mcore_model", None)])


megatron_flat.install = record_install
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
print(json.dumps(EVENTS))
'''


def load_apply():
    spec = importlib.util.spec_from_file_location("flat_patches_apply",
                                                  REPO / "patches" / "apply.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def apply():
    """``patches/apply.py`` as a module."""
    return load_apply()


@pytest.fixture
def megatron_dir(tmp_path):
    """``write(text) -> path``: a fake Megatron-LM checkout holding ``pretrain_gpt.py``."""
    root = tmp_path / "Megatron-LM"
    root.mkdir()

    def write(text, newline="\n"):
        path = root / "pretrain_gpt.py"
        path.write_bytes(text.replace("\n", newline).encode())
        return path

    return write


@pytest.fixture
def stub_megatron(tmp_path):
    """Directory with the stub ``megatron.training`` (+ ModelOpt provider) and the harness."""
    root = tmp_path / "stubs"
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "megatron" / "post_training").mkdir(parents=True)
    (root / "megatron" / "training" / "__init__.py").write_text(_STUB_TRAINING)
    (root / "megatron" / "post_training" / "__init__.py").write_text("")
    (root / "megatron" / "post_training" / "arguments.py").write_text(_STUB_MODELOPT)
    (root / "harness.py").write_text(textwrap.dedent(_HARNESS))
    return root


@pytest.fixture
def script_016():
    return SCRIPT_016


@pytest.fixture
def script_019():
    return SCRIPT_019
