"""The rehearsal's preflight: packages the runs import lazily (the torch_dist checkpoint
writer's psutil, a tokenizer's package) are looked up before anything is launched, and a line
whose environment lacks one is refused with one message and the install command."""

import sys
import time
from pathlib import Path

import pytest

from megatron_flat.rehearse import command as rehearse, preflight

sys.path.insert(0, str(Path(__file__).parent))
import rehearsal_checkout as checkout  # noqa: E402


def test_checkpoint_writer_needs_psutil_only_when_the_runs_save():
    values = {"ckpt_format": "torch_dist", "tokenizer_type": "NullTokenizer"}
    assert preflight.needs(values, checkpoints=False) == []
    (need,) = preflight.needs(values, checkpoints=True)
    assert need.module == "psutil" and "torch_dist" in need.why
    # Megatron-LM's default format is torch_dist: a line that does not name one needs it too.
    assert [n.module for n in preflight.needs({}, checkpoints=True)] == ["psutil"]
    assert preflight.needs({"ckpt_format": "torch"}, checkpoints=True) == []


@pytest.mark.parametrize("tokenizer, module", [
    ("HuggingFaceTokenizer", "transformers"), ("SentencePieceTokenizer", "sentencepiece"),
    ("TikTokenizer", "tiktoken"), ("GPT2BPETokenizer", "regex")])
def test_tokenizers_name_their_package(tokenizer, module):
    (need,) = preflight.needs({"tokenizer_type": tokenizer, "mock_data": True},
                              checkpoints=False)
    assert need.module == module and tokenizer in need.why


def test_missing_and_the_refusal_name_the_package_and_the_install_command():
    values = {"ckpt_format": "torch_dist", "tokenizer_type": "TikTokenizer"}
    absent = preflight.missing(values, checkpoints=True,
                               find=lambda name: None if name in ("psutil", "tiktoken") else 1)
    assert [n.module for n in absent] == ["psutil", "tiktoken"]
    text = preflight.refusal(absent)
    assert "psutil is not installed" in text and "tiktoken is not installed" in text
    assert text.splitlines()[-1] == f"install with: {sys.executable} -m pip install psutil tiktoken"
    assert preflight.missing(values, checkpoints=True, find=lambda name: 1) == []


def test_a_resume_rehearsal_without_psutil_is_refused_before_launch(tmp_path, capsys,
                                                                    monkeypatch):
    """The hang that motivated this (--resume-at on an environment without psutil) ends at
    once: refused, exit 2, no run started, the install command printed."""
    script = checkout.write_checkout(tmp_path / "mlm", "0.19")
    launched = []
    monkeypatch.setattr(rehearse, "launch", lambda *a, **k: launched.append(a))
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec",
                        lambda name, *a: None if name == "psutil" else real(name, *a))
    start = time.monotonic()
    code = rehearse.main(["--nproc-per-node", "1", "--iters", "5", "--resume-at", "2",
                          "--work-dir", str(tmp_path / "work"), "--",
                          str(script), *checkout.LINE, "--flat-dispatch", "pipelined"])
    captured = capsys.readouterr()
    err = captured.err
    assert code == rehearse.EXIT_USAGE and launched == []
    assert "psutil is not installed" in err and "-m pip install psutil" in err
    # the report's verdict line says it was refused, and why
    verdict = captured.out.splitlines()[-1]
    assert verdict.startswith("rehearsal: refused: ") and "psutil" in verdict, verdict
    assert time.monotonic() - start < 120  # the probe's subprocess, nothing more
