"""Ring-DTP plan: which schedule, which vocab range each shard holds, how wide a strip is.

Pure: every rank describes itself in one row of integers (:func:`describe_rank`), the rows
of all ranks are gathered (one small collective, in :mod:`megatron_flat.vocab.ring`), and
:func:`make_plan` turns the same table into the same :class:`RingPlan` on every rank, or
raises the same ``ValueError`` on every rank. That is what makes bad input safe in a
collective op: the check runs before any ring hop, and either all ranks raise or none do,
so no rank is left waiting in a send.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "IGNORE_INDEX",
    "DEFAULT_BLOCK_SIZE",
    "MODES",
    "RingPlan",
    "describe_rank",
    "make_plan",
    "error_row",
    "raise_for_peer_errors",
    "resolve_mode",
]

IGNORE_INDEX = -100
# Vocab strip width of the single-device (P = 1) version when none is given: an
# N x 8192 fp32 strip, small against N x V for any real vocabulary.
DEFAULT_BLOCK_SIZE = 8192
MODES = ("auto", "weights", "activations")

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Columns of the per-rank description row.
_FIELDS = (
    "n_tokens",  # tokens this rank holds (N_local)
    "rows",  # rows of its weight shard (V/P, padding included)
    "hidden",  # H
    "vocab_start",  # first vocab id of its shard, -1 = default (prefix sum of rows)
    "vocab_size",  # true (unpadded) V, -1 = default
    "mode",  # index in MODES
    "block_size",  # strip width, 0 = default
    "dtype",  # index in _DTYPES
    "label_min",  # smallest active label (or large sentinel)
    "label_max",  # largest active label (or -1)
    "needs_dx",
    "needs_dw",
    "tile_bytes",  # bytes of one token tile of a strip, 0 = untiled (whole strips)
    "error",  # 1 = this rank found its own inputs malformed (it raises its own message)
)
_NO_LABEL_MIN = 2**62


def describe_rank(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    active: torch.Tensor,
    *,
    mode: str,
    vocab_start: Optional[int],
    vocab_size: Optional[int],
    block_size: Optional[int],
    check_labels: bool = True,
    tile_bytes: Optional[int] = None,
) -> torch.Tensor:
    """This rank's row of the plan table (int64 ``[len(_FIELDS)]``, on CPU).

    ``active`` (bool ``[N]``) marks tokens that count: only their labels are checked.
    ``check_labels=False`` leaves the label range out of the row (reading it is a host
    sync on a GPU): the row then depends on shapes and settings only.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if hidden.dtype not in _DTYPES or weight_shard.dtype != hidden.dtype:
        raise TypeError(
            f"hidden and weight_shard must share a float dtype among {_DTYPES}, got "
            f"{hidden.dtype} and {weight_shard.dtype}"
        )
    if block_size is not None and (isinstance(block_size, bool) or int(block_size) < 1):
        raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")
    if tile_bytes is not None and (isinstance(tile_bytes, bool) or int(tile_bytes) < 1):
        raise ValueError(f"tile_bytes must be a positive int or None, got {tile_bytes!r}")
    if vocab_start is not None and int(vocab_start) < 0:
        raise ValueError(f"vocab_start must be >= 0 or None, got {vocab_start!r}")
    if vocab_size is not None and int(vocab_size) < 1:
        raise ValueError(f"vocab_size must be >= 1 or None, got {vocab_size!r}")
    lo, hi = _NO_LABEL_MIN, -1
    if check_labels:
        picked = labels[active]
        if picked.numel():
            lo, hi = int(picked.min()), int(picked.max())
    row = [
        hidden.shape[0],
        weight_shard.shape[0],
        hidden.shape[1],
        -1 if vocab_start is None else int(vocab_start),
        -1 if vocab_size is None else int(vocab_size),
        MODES.index(mode),
        0 if block_size is None else int(block_size),
        _DTYPES.index(hidden.dtype),
        lo,
        hi,
        int(hidden.requires_grad),
        int(weight_shard.requires_grad),
        0 if tile_bytes is None else int(tile_bytes),
        0,
    ]
    return torch.tensor(row, dtype=torch.int64)


def error_row() -> torch.Tensor:
    """The row a rank sends when its own inputs are malformed (so its peers raise too)."""
    row = torch.zeros(len(_FIELDS), dtype=torch.int64)
    row[_FIELDS.index("error")] = 1
    return row


def raise_for_peer_errors(table: torch.Tensor) -> None:
    """Raise ``ValueError`` if any rank flagged its inputs as malformed."""
    flagged = table[:, _FIELDS.index("error")].nonzero().flatten().tolist()
    if flagged:
        raise ValueError(
            f"ring_dtp_cross_entropy: rank(s) {flagged} of the group rejected their inputs "
            "(their error says why); no rank entered the ring"
        )


# A travelling gradient sum is relayed in this many pieces (:meth:`.ring.Ring.relay`); its
# slot is one piece: 1/RELAY_PIECES of the buffer.
RELAY_PIECES = 8


def relay_piece_rows(sizes) -> int:
    """Rows per relay piece for travelling sums of ``sizes`` rows (one per ring item): the
    same on every rank, from sizes every rank knows."""
    return max(1, -(-max(sizes, default=0) // RELAY_PIECES))


def relay_pieces(rows: int, piece_rows: int) -> int:
    """Pieces (one exchange each) that carry ``rows`` rows."""
    return -(-rows // piece_rows)


def resolve_mode(mode: str, max_tokens: int, max_rows: int, world: int) -> str:
    """The schedule ``mode`` means for this group.

    ``"auto"`` moves activations when ``N <= V/P`` and weights otherwise, where ``N`` is
    the largest per-rank token count in the group (every rank must run the same schedule,
    and the largest batch sets the hop time) and ``V/P`` the (largest) shard's rows: a hop
    then moves ``N x H`` rather than ``V/P x H`` elements, whichever is fewer. With one rank
    there is no ring: ``"blocked"``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if world == 1:
        return "blocked"
    if mode == "auto":
        return "activations" if max_tokens <= max_rows else "weights"
    return mode


@dataclass(frozen=True)
class RingPlan:
    """What every rank of the ring agrees on before the first hop."""

    mode: str  # "blocked" (P = 1), "weights" or "activations"
    world: int  # P
    rank: int  # this rank's index in the group
    n_tokens: tuple[int, ...]  # per rank
    rows: tuple[int, ...]  # weight shard rows per rank (padding included)
    starts: tuple[int, ...]  # first vocab id per shard
    vocab_size: int  # true V
    hidden: int
    block_size: int  # strip width in vocab rows
    needs_dx: bool  # some rank wants d hidden
    needs_dw: bool  # some rank wants d weight
    tile_bytes: int = 0  # a token tile of a strip at most this big (0: whole strips)
    acc_bytes: int = 4  # bytes per element of a strip (fp32; fp64 inputs: 8)

    def tile_rows(self, shard: int) -> Optional[int]:
        """Tokens per tile of ``shard``'s strips (None: untiled): as many as fit
        ``tile_bytes`` at the shard's widest strip, at least one."""
        if not self.tile_bytes:
            return None
        width = max((b1 - b0 for b0, b1 in self.blocks(shard)), default=1)
        return max(1, self.tile_bytes // (width * self.acc_bytes))

    def valid_rows(self, shard: int) -> int:
        """Rows of ``shard`` that are real vocabulary (the rest is padding)."""
        return max(0, min(self.rows[shard], self.vocab_size - self.starts[shard]))

    def blocks(self, shard: int) -> list[tuple[int, int]]:
        """``(first row, end row)`` of each strip of ``shard``'s real rows.

        As few strips as ``block_size`` allows, of equal width (within one row), so no
        strip is a sliver: 25,000 rows at block size 8192 are 4 strips of 6250.
        """
        valid = self.valid_rows(shard)
        if valid == 0:
            return []
        count = -(-valid // self.block_size)
        edges = [valid * i // count for i in range(count + 1)]
        return list(zip(edges, edges[1:]))


def _agree(table: torch.Tensor, field: str) -> int:
    col = table[:, _FIELDS.index(field)]
    values = sorted(set(col.tolist()))
    if len(values) != 1:
        raise ValueError(
            f"ring_dtp_cross_entropy: ranks disagree on {field} (per rank: {col.tolist()})"
        )
    return values[0]


def make_plan(table: torch.Tensor, rank: int, ignore_index: int = IGNORE_INDEX) -> RingPlan:
    """The plan from the gathered table (``[P, fields]``, row i from group rank i).

    Raises ``ValueError`` (identically on every rank, since every rank sees the same
    table) for: ranks that disagree on H, dtype, mode, vocab_size, block_size or tile_bytes;
    shards whose real vocab ranges overlap or leave a gap in ``[0, vocab_size)``;
    active labels outside ``[0, vocab_size)`` (padded rows included), on any rank.
    """
    col = {f: table[:, i].tolist() for i, f in enumerate(_FIELDS)}
    world = table.shape[0]
    hidden = _agree(table, "hidden")
    dtype = _DTYPES[_agree(table, "dtype")]
    tile_bytes = _agree(table, "tile_bytes")
    acc_bytes = 8 if dtype == torch.float64 else 4
    mode = MODES[_agree(table, "mode")]
    block_size = _agree(table, "block_size")
    given_v = _agree(table, "vocab_size")
    rows = tuple(col["rows"])
    default_starts = [sum(rows[:i]) for i in range(world)]
    starts = tuple(
        s if s >= 0 else d for s, d in zip(col["vocab_start"], default_starts)
    )
    vocab_size = given_v if given_v >= 0 else max(s + r for s, r in zip(starts, rows))
    if vocab_size < 1:
        raise ValueError(f"ring_dtp_cross_entropy: vocab_size must be >= 1, got {vocab_size}")

    # The shards' real ranges must tile [0, vocab_size) exactly.
    spans = sorted(
        (s, min(s + r, vocab_size), q) for q, (s, r) in enumerate(zip(starts, rows))
        if min(s + r, vocab_size) > s
    )
    pos = 0
    for s, e, q in spans:
        if s != pos:
            what = "overlaps" if s < pos else "leaves a gap before"
            raise ValueError(
                f"ring_dtp_cross_entropy: shard of rank {q} (vocab [{s}, {e})) {what} vocab id "
                f"{pos}; starts={list(starts)}, rows={list(rows)}, vocab_size={vocab_size}"
            )
        pos = e
    if pos != vocab_size:
        raise ValueError(
            f"ring_dtp_cross_entropy: shards cover [0, {pos}) but vocab_size is {vocab_size}; "
            f"starts={list(starts)}, rows={list(rows)}"
        )

    # Label range judged here, against the agreed vocab_size, so every rank decides alike.
    bad = [
        (q, lo, hi)
        for q, (lo, hi) in enumerate(zip(col["label_min"], col["label_max"]))
        if lo != _NO_LABEL_MIN and (lo < 0 or hi >= vocab_size)
    ]
    if bad:
        padded = sum(rows) > vocab_size
        detail = "; ".join(f"rank {q}: labels in [{lo}, {hi}]" for q, lo, hi in bad)
        raise ValueError(
            f"ring_dtp_cross_entropy: labels must lie in [0, vocab_size={vocab_size}) or equal "
            f"ignore_index={ignore_index} (or be masked out); {detail}"
            + (f". Ids >= {vocab_size} are padded vocab rows, never targets." if padded else "")
        )

    if block_size == 0:
        block_size = DEFAULT_BLOCK_SIZE if world == 1 else max(max(rows), 1)
    if tile_bytes:  # a tile of one token must fit too: strips no wider than the tile
        block_size = min(block_size, max(1, tile_bytes // acc_bytes))
    return RingPlan(
        mode=resolve_mode(mode, max(col["n_tokens"]), max(rows), world),
        world=world,
        rank=rank,
        n_tokens=tuple(col["n_tokens"]),
        rows=rows,
        starts=starts,
        vocab_size=vocab_size,
        hidden=hidden,
        block_size=block_size,
        needs_dx=any(col["needs_dx"]),
        needs_dw=any(col["needs_dw"]),
        tile_bytes=tile_bytes,
        acc_bytes=acc_bytes,
    )
