"""Size parsing and formatting for the planner CLI."""

import pytest

from megatron_flat.plan import PlanError, format_bytes, format_tokens, parse_bytes, parse_tokens


@pytest.mark.parametrize("text, tokens", [
    ("1M", 1 << 20), ("128K", 128 << 10), ("128k", 128 << 10), ("1.5M", 3 << 19),
    ("5000", 5000), (" 2M ", 2 << 20), ("1G", 1 << 30), (4096, 4096),
])
def test_parse_tokens(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("text, nbytes", [
    ("141GiB", 141 << 30), ("2TiB", 2 << 40), ("80GB", 80 * 10**9), ("2T", 2 << 40),
    ("141G", 141 << 30), ("512", 512), ("512B", 512), ("1.5TiB", 3 << 39), ("64MiB", 64 << 20),
    ("1TB", 10**12), ("141gib", 141 << 30),
])
def test_parse_bytes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["", "abc", "1X", "0", "-1M", "1GiB", "M"])
def test_bad_token_counts_are_refused(text):
    with pytest.raises(PlanError, match="token count"):
        parse_tokens(text)


@pytest.mark.parametrize("text", ["", "lots", "12Gi", "0GiB", "-5GB", "1.2.3G"])
def test_bad_memory_sizes_are_refused(text):
    with pytest.raises(PlanError, match="memory size"):
        parse_bytes(text)


def test_formatting():
    assert format_tokens(1 << 20) == "1M"
    assert format_tokens(3 << 19) == "1.5M"
    assert format_tokens(128 << 10) == "128K"
    assert format_tokens(1000) == "1000"
    assert format_bytes(141 << 30) == "141.00 GiB"
    assert format_bytes(2 << 40) == "2.00 TiB"
    assert format_bytes(100) == "100 B"
