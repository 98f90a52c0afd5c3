"""Context parallelism at 4 ranks: CP 2 × TP 2 × EP 2 (sequence parallelism, experts without expert-TP), with full recompute. Stock equals the single-rank
model; each technique, and all four, equal stock. See ``_cp.py`` for what each test proves.
(One layout per file: each torchrun process keeps the gloo threads of every group it made.)"""

import functools
import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.world(4)

_spec = importlib.util.spec_from_file_location("_cp", pathlib.Path(__file__).with_name("_cp.py"))
cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp)

LAYOUT = dict(cp=2, tp=2, etp=1, ep=2, recompute="full")


@functools.lru_cache(maxsize=None)
def case():
    from megatron_flat.testing.equivalence import Layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    # 32 tokens: each rank keeps a quarter (CP 2 × SP 2), 16 per step's microbatch of 2, so
    # PipelinedLLEP's 8-token chunks make several.
    return cp.CPCase(TinyMoE(seq_length=32), Layout(**LAYOUT))


def test_stock_cp_equals_single_rank(megatron_cpu):
    case().assert_stock_matches_single_rank()


@pytest.mark.parametrize("technique", list(cp.TECHNIQUES))
def test_technique_under_cp_equals_stock(megatron_cpu, technique):
    case().assert_technique_matches_stock(technique)


def test_all_four_under_cp_equal_stock(megatron_cpu):
    case().assert_all_four_match_stock()
