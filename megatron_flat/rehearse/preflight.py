"""What a rehearsal's runs will import, checked before anything is launched.

Megatron-LM imports some packages only when a run reaches the code that needs them, in a rank
or in a process a rank forks: the torch_dist checkpoint writer's worker processes import
``psutil`` (``dist_checkpointing/strategies/filesystem_async.py``), and when it is missing they
die while the ranks wait for them forever. megatron-core does not declare these packages. The
rehearsal therefore asks, from the line as the checkout's own parser reads it
(``rehearse.probe``), which of them the runs will need, and refuses a line whose
environment lacks one with one message naming the package and the install command — before
any process starts.

:func:`needs` is pure (the parsed settings in, the packages out); :func:`missing` looks them up
in this interpreter, which is the one the rehearsal's ranks run.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional

__all__ = ["Need", "missing", "needs", "refusal"]


@dataclass(frozen=True)
class Need:
    """One package a run will import: its import name, its pip name, and what needs it."""

    module: str
    pip: str
    why: str


# --tokenizer-type -> the package its tokenizer imports (Megatron-LM's tokenizer builders).
TOKENIZER_PACKAGES = {
    "HuggingFaceTokenizer": ("transformers", "transformers"),
    "SentencePieceTokenizer": ("sentencepiece", "sentencepiece"),
    "GPTSentencePieceTokenizer": ("sentencepiece", "sentencepiece"),
    "Llama2Tokenizer": ("sentencepiece", "sentencepiece"),
    "TikTokenizer": ("tiktoken", "tiktoken"),
    "GPT2BPETokenizer": ("regex", "regex"),
}
# Checkpoint formats whose writer forks worker processes that import psutil.
FORKING_WRITERS = ("torch_dist", "fsdp_dtensor")


def needs(values: Mapping[str, Any], *, checkpoints: bool) -> List[Need]:
    """The packages the runs of a line with parsed settings ``values`` will import lazily.
    ``checkpoints``: whether the runs save or load (a rehearsal drops ``--save`` / ``--load``
    unless ``--resume-at`` asks for crossings)."""
    found: List[Need] = []
    if checkpoints:
        fmt = values.get("ckpt_format") or "torch_dist"  # Megatron-LM's default
        if fmt in FORKING_WRITERS:
            found.append(Need("psutil", "psutil",
                              f"the {fmt} checkpoint writer's worker processes "
                              f"(--ckpt-format {fmt}, saving for --resume-at)"))
        elif fmt == "zarr":
            found.append(Need("zarr", "zarr", "--ckpt-format zarr"))
    tokenizer = values.get("tokenizer_type")  # built with mock data too (the vocabulary size)
    if tokenizer in TOKENIZER_PACKAGES:
        module, pip = TOKENIZER_PACKAGES[tokenizer]
        found.append(Need(module, pip, f"--tokenizer-type {tokenizer}"))
    return found


def missing(values: Mapping[str, Any], *, checkpoints: bool,
            find: Optional[Callable[[str], Optional[object]]] = None) -> List[Need]:
    """The :func:`needs` this interpreter cannot import (``find``: how a module is looked
    up, ``importlib.util.find_spec`` by default)."""
    find = find or importlib.util.find_spec
    return [need for need in needs(values, checkpoints=checkpoints) if find(need.module) is None]


def refusal(absent: List[Need]) -> str:
    """One message naming every missing package, what needs it, and the install command."""
    lines = [f"{n.module} is not installed in this Python ({sys.executable}); "
             f"{n.why} import it" for n in absent]
    pips = " ".join(sorted({n.pip for n in absent}))
    return ("the runs would fail (or wait forever) on packages this environment lacks:\n  - "
            + "\n  - ".join(lines) + f"\ninstall with: {sys.executable} -m pip install {pips}")
