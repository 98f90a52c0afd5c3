"""Sequence tiles of the attention block (pure planning: integers in, a plan out).

Under sequence parallelism each of the TP ranks holds ``n_local`` consecutive rows of the
sequence (rank r: global rows ``r·n_local + [0, n_local)``). Stock Megatron all-gathers the
whole N × H input before the QKV projection, and builds the whole N × H partial output of the
output projection before its reduce-scatter. A :class:`SequenceTiles` plan cuts that work into
tiles: tile j takes rows ``[j·s, min((j+1)·s, n_local))`` of *every* rank's shard, so one
gathered tile holds ``TP·s`` rows — TP pieces of ``s`` rows, piece r at global rows
``r·n_local + j·s + [0, s)`` — and only one tile is ever gathered at a time.

The tile size is fixed before launch (``rows`` per rank per tile, i.e. ``TP·rows`` tokens per
gathered tile), so the working set does not grow with N; the plan is a pure function of
``(n_local, tp, rows)``, which every rank of the group computes alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Tuple

__all__ = ["SequenceTiles", "rows_for_tokens", "rows_for_bytes"]


@dataclass(frozen=True)
class SequenceTiles:
    """Tiles over a sequence-parallel shard: ``n_local`` rows per rank, ``tp`` ranks,
    ``rows`` rows of each rank's shard per tile (the last tile may be shorter)."""

    n_local: int
    tp: int
    rows: int

    def __post_init__(self) -> None:
        for name in ("n_local", "tp", "rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SequenceTiles.{name} must be a positive int, got {value!r}")

    @property
    def count(self) -> int:
        """Number of tiles (collectives per projection and direction)."""
        return -(-self.n_local // self.rows)

    @property
    def gathered_rows(self) -> int:
        """Rows of the largest gathered tile (``tp·rows``, or all of N with one tile)."""
        return self.tp * min(self.rows, self.n_local)

    def bounds(self) -> Iterator[Tuple[int, int]]:
        """``(start, stop)`` of each tile within a rank's shard, in order."""
        for start in range(0, self.n_local, self.rows):
            yield start, min(start + self.rows, self.n_local)

    def global_rows(self, start: int, stop: int) -> Iterator[Tuple[int, int]]:
        """The global row ranges of the tile ``[start, stop)``, one per rank, rank-major
        (the order of a gathered tile's pieces)."""
        for rank in range(self.tp):
            yield rank * self.n_local + start, rank * self.n_local + stop


def rows_for_tokens(tokens: int, tp: int) -> int:
    """Rows per rank per tile for a gathered tile of at most ``tokens`` tokens (at least 1)."""
    if tokens < 1 or tp < 1:
        raise ValueError(f"tile tokens and TP must be >= 1, got {tokens} and {tp}")
    return max(1, tokens // tp)


def rows_for_bytes(tile_bytes: int, tp: int, row_bytes: int) -> int:
    """Rows per rank per tile so that one gathered tile (``tp·rows`` rows of ``row_bytes``
    each: micro-batch × hidden × element size) takes at most ``tile_bytes`` (at least 1)."""
    if tile_bytes < 1 or tp < 1 or row_bytes < 1:
        raise ValueError(f"tile bytes, TP and row bytes must be >= 1, got {tile_bytes}, "
                         f"{tp} and {row_bytes}")
    return max(1, tile_bytes // (tp * row_bytes))
