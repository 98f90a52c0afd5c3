"""HostPool: budget, first-fit reuse, coalescing, alignment, threads, errors."""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
import torch

from megatron_flat.runtime import HostPool, host_pool


def _offset(pool: HostPool, tensor: torch.Tensor) -> int:
    return tensor.data_ptr() - pool._buffer.data_ptr()


def test_acquire_until_exhausted_returns_none() -> None:
    pool = HostPool(4096, alignment=512)
    blocks = [pool.acquire((128,), torch.float32) for _ in range(8)]  # 512 B each
    assert all(b is not None for b in blocks)
    assert pool.used_bytes == 4096 and pool.free_bytes == 0
    assert pool.acquire((1,), torch.uint8) is None
    assert pool.acquire((128,), torch.float32) is None
    stats = pool.stats()
    assert stats["acquires"] == 8
    assert stats["failed_acquires"] == 2
    assert stats["largest_free_block"] == 0
    assert stats["live_blocks"] == 8
    # Blocks never overlap.
    offsets = sorted(_offset(pool, b) for b in blocks)  # type: ignore[arg-type]
    assert offsets == [i * 512 for i in range(8)]


def test_request_larger_than_budget_returns_none() -> None:
    pool = HostPool(1000, alignment=8)
    assert pool.acquire((1001,), torch.uint8) is None
    assert pool.acquire((1000,), torch.uint8) is not None


def test_release_and_reuse() -> None:
    pool = HostPool(2048, alignment=512)
    a, b, c, d = (pool.acquire((512,), torch.uint8) for _ in range(4))
    assert pool.acquire((1,), torch.uint8) is None
    b_offset = _offset(pool, b)  # type: ignore[arg-type]
    pool.release(b)  # type: ignore[arg-type]
    assert pool.used_bytes == 1536
    again = pool.acquire((100,), torch.int32)  # 400 B fits the freed 512 B slot
    assert again is not None and _offset(pool, again) == b_offset
    stats = pool.stats()
    assert stats["releases"] == 1 and stats["acquires"] == 5
    assert pool.peak_used_bytes == 2048


def test_coalescing_merges_neighbours() -> None:
    pool = HostPool(4096, alignment=1024)
    blocks = [pool.acquire((1024,), torch.uint8) for _ in range(4)]
    pool.release(blocks[1])  # type: ignore[arg-type]
    pool.release(blocks[2])  # type: ignore[arg-type]  # merges with its left neighbour
    assert pool.stats()["largest_free_block"] == 2048
    mid = pool.acquire((2048,), torch.uint8)
    assert mid is not None and _offset(pool, mid) == 1024
    pool.release(mid)
    pool.release(blocks[0])  # merges right
    pool.release(blocks[3])  # merges left: one block again
    assert pool.stats()["largest_free_block"] == 4096
    assert pool._free.starts == [0] and pool._free.sizes == [4096]
    assert pool.used_bytes == 0
    whole = pool.acquire((1024,), torch.float32)
    assert whole is not None and _offset(pool, whole) == 0


def test_offsets_are_aligned_and_sizes_rounded() -> None:
    pool = HostPool(4096, alignment=256)
    tensors = [pool.acquire((n,), torch.uint8) for n in (1, 3, 100)]
    for t in tensors:
        assert t is not None and _offset(pool, t) % 256 == 0
    assert pool.used_bytes == 3 * 256


def test_dtype_item_size_beyond_alignment_is_respected() -> None:
    pool = HostPool(64, alignment=1)
    head = pool.acquire((3,), torch.uint8)
    wide = pool.acquire((2,), torch.float64)
    assert head is not None and wide is not None
    assert _offset(pool, wide) == 8  # not 3: float64 needs 8-byte offsets
    # The 5 B gap left before it is still free and reused first.
    filler = pool.acquire((5,), torch.uint8)
    assert filler is not None and _offset(pool, filler) == 3
    assert pool.used_bytes == 3 + 16 + 5


def test_alignment_padding_counts_against_the_block() -> None:
    pool = HostPool(20, alignment=1)
    assert pool.acquire((3,), torch.uint8) is not None
    # 17 B are free at offset 3, but 16 B at an 8-aligned offset need 21.
    assert pool.acquire((2,), torch.float64) is None
    assert pool.stats()["largest_free_block"] == 17


def test_shape_dtype_and_views() -> None:
    pool = HostPool(1 << 16)
    t = pool.acquire((4, 8), torch.bfloat16)
    assert t is not None
    assert t.shape == (4, 8) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.device.type == "cpu"
    assert pool.pinned is (torch.cuda.is_available())
    scalar = pool.acquire((), torch.float64)
    assert scalar is not None and scalar.shape == () and scalar.dtype == torch.float64
    one_d = pool.acquire(7, torch.int64)
    assert one_d is not None and one_d.shape == (7,)


def test_data_survives_until_release() -> None:
    pool = HostPool(4096, alignment=512)
    a = pool.acquire((64,), torch.float32)
    assert a is not None
    a.copy_(torch.arange(64, dtype=torch.float32))
    others = [pool.acquire((128,), torch.float32) for _ in range(7)]
    for i, o in enumerate(others):
        assert o is not None
        o.fill_(-1.0 - i)
    assert torch.equal(a, torch.arange(64, dtype=torch.float32))
    offset = _offset(pool, a)
    pool.release(a)
    b = pool.acquire((128,), torch.float32)
    # The freed bytes are handed out again; the other blocks are untouched.
    assert b is not None and _offset(pool, b) == offset
    b.fill_(7.0)
    for i, o in enumerate(others):
        assert torch.all(o == -1.0 - i)  # type: ignore[operator]


def test_zero_budget_and_zero_byte_requests() -> None:
    pool = HostPool(0)
    assert pool.capacity_bytes == 0 and pool.free_bytes == 0
    assert pool.acquire((1,), torch.uint8) is None
    empty = pool.acquire((0, 4), torch.float32)
    assert empty is not None and empty.shape == (0, 4) and empty.dtype == torch.float32
    pool.release(empty)
    stats = pool.stats()
    assert stats["failed_acquires"] == 1
    assert stats["acquires"] == 1 and stats["releases"] == 1
    assert stats["largest_free_block"] == 0 and pool.used_bytes == 0

    full = HostPool(512)
    assert full.acquire((512,), torch.uint8) is not None
    # A zero-byte request succeeds even when the pool is full.
    assert full.acquire((0,), torch.float16) is not None


def test_release_errors() -> None:
    pool = HostPool(4096)
    other = HostPool(4096)
    t = pool.acquire((16,), torch.float32)
    foreign = other.acquire((16,), torch.float32)
    assert t is not None and foreign is not None
    with pytest.raises(ValueError):
        pool.release(torch.empty(16))
    with pytest.raises(ValueError):
        pool.release(foreign)
    with pytest.raises(ValueError):
        pool.release(t[1:])  # a view not starting at an acquired block
    with pytest.raises(ValueError):
        # Same bytes, but a different storage: not handed out by this pool.
        pool.release(torch.from_numpy(t.numpy()))
    with pytest.raises(TypeError):
        pool.release("not a tensor")  # type: ignore[arg-type]
    pool.release(t)
    with pytest.raises(ValueError):
        pool.release(t)  # double release
    assert pool.used_bytes == 0 and pool.stats()["releases"] == 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"budget_bytes": -1}, ValueError),
        ({"budget_bytes": 1.5}, TypeError),
        ({"budget_bytes": True}, TypeError),
        ({"budget_bytes": 64, "alignment": 0}, ValueError),
        ({"budget_bytes": 64, "alignment": 3}, ValueError),
        ({"budget_bytes": 64, "pin_memory": "yes"}, TypeError),
    ],
)
def test_constructor_validation(kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        HostPool(**kwargs)


def test_acquire_validation() -> None:
    pool = HostPool(1024)
    with pytest.raises(ValueError):
        pool.acquire((-1,), torch.float32)
    with pytest.raises(ValueError):
        pool.acquire((2.0,), torch.float32)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pool.acquire((2,), "float32")  # type: ignore[arg-type]
    assert pool.stats()["acquires"] == 0 and pool.stats()["failed_acquires"] == 0


def test_concurrent_acquire_release_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    real_round_up = host_pool._round_up

    def yielding_round_up(value: int, multiple: int) -> int:
        # Hand the GIL over in the middle of the free-list search, where an
        # unlocked pool would give one block to two threads.
        time.sleep(0)
        return real_round_up(value, multiple)

    monkeypatch.setattr(host_pool, "_round_up", yielding_round_up)
    pool = HostPool(64 * 1024, alignment=64)
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[torch.Tensor] = []
        for _ in range(300):
            if held and (rng.random() < 0.5 or len(held) > 8):
                t = held.pop(rng.randrange(len(held)))
                # Nobody else wrote into this block while it was ours.
                if not torch.all(t == seed):
                    errors.append(f"block of thread {seed} was overwritten")
                pool.release(t)
            else:
                t = pool.acquire((rng.randint(1, 2048),), torch.int32)
                if t is not None:
                    t.fill_(seed)
                    held.append(t)
        for t in held:
            pool.release(t)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    # Switch threads as often as possible so that races have a chance to show.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    stats = pool.stats()
    assert stats["used_bytes"] == 0 and stats["live_blocks"] == 0
    assert stats["acquires"] == stats["releases"]
    assert stats["largest_free_block"] == pool.capacity_bytes
    assert 0 < stats["peak_used_bytes"] <= pool.capacity_bytes
