"""SpanMover's release under late copies: host bytes go back to the pool only after the last
copy that reads them has landed (the reload), even when the pool is so small that the next
offload needs those very bytes at once."""

from __future__ import annotations

import torch

from megatron_flat.checkpoint.transfer import SpanMover
from megatron_flat.runtime import HostPool
from megatron_flat.runtime.streams import delayed_copies, delayed_copy_count

N = 1024  # bytes of one span: the pool holds exactly one


def test_released_bytes_are_reused_only_after_their_reload_landed():
    """Offload A, reload A without waiting, release A, offload B into the same (only) block,
    then wait for A's reload: A's bytes arrive intact. Handing A's block back at release
    (before its reload copy ran) lets B's offload overwrite it first: A comes back as B's
    bytes or poison."""
    pool = HostPool(N, alignment=N)
    mover = SpanMover(pool)
    a = torch.arange(N, dtype=torch.int64).remainder(251).to(torch.uint8)
    b = torch.full((N,), 7, dtype=torch.uint8)
    before = delayed_copy_count()
    with delayed_copies():
        span_a = mover.offload(a)
        assert span_a is not None
        buffer, ready = mover.reload(span_a)      # queued on the h2d stream, not done yet
        mover.release(span_a)                      # the reload still reads A's host bytes
        span_b = mover.offload(b)                  # needs the pool's only block
        assert span_b is not None
        ready.wait()
        got = buffer.clone()
        mover.release(span_b)
        mover.synchronize()
    assert delayed_copy_count() - before >= 3      # the copies really were late
    assert torch.equal(got, a)
    assert pool.used_bytes == 0


def test_synchronize_means_every_copy_has_landed():
    """After ``synchronize`` a span's host bytes hold the offloaded data and a reload's buffer
    holds the span's, with no event waited on by the caller; without the side streams'
    synchronisation both would still be poison under delayed copies."""
    pool = HostPool(4 * N, alignment=N)
    mover = SpanMover(pool)
    a = torch.arange(N, dtype=torch.int64).remainder(241).to(torch.uint8)
    b = torch.arange(N, dtype=torch.int64).remainder(239).to(torch.uint8)
    with delayed_copies():
        span_a, span_b = mover.offload(a), mover.offload(b)
        assert span_a is not None and span_b is not None
        buffer, _ = mover.reload(span_a)
        mover.synchronize()
        host_b, got = span_b.host.clone(), buffer.clone()
        mover.release(span_a)
        mover.release(span_b)
        mover.synchronize()
    assert torch.equal(host_b, b)
    assert torch.equal(got, a)
    assert pool.used_bytes == 0
