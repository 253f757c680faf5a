"""Documents packed back to back for one profiling forward: the geometry every stage of a pack reads.

A pack holds sequences s = 0..B-1, each the profiling prefix (`n_prefix` tokens), document s (`lengths[s]` tokens)
and, for the reader criterion, the reader text (`n_reader` tokens, 0 otherwise), at rows [starts[s], starts[s] +
n_prefix + lengths[s] + n_reader) of one [1, total] forward. Positions
restart at 0 in every sequence and no sequence attends to another (block-diagonal causal attention), so each
document sees exactly what it sees when it is profiled alone.

A layer's bits go to two uint8 buffers, LA [Hq, la_total] and CA [Hq, ca_total]: document s owns bytes
[la_offsets[s], la_offsets[s] + la_nbytes[s]) of every head's LA row (and likewise for CA), its own vectors as
SPEC section 2 lays them out. Stacked over layers, `buffer[:, :, off:off + nbytes]` in C order is exactly the
document's `la_bits` / `ca_bits` (layer, then head, each head byte-aligned).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from sift.format import TILES, ca_nbytes, la_nbytes, n_pages


@dataclass(frozen=True)
class PackedDocs:
    """The layout of one pack (host side, plain ints). Build with `PackedDocs(n_prefix, lengths, tile)`, or
    `PackedDocs(n_prefix, lengths, tile, n_reader)` where a reader text follows every document."""

    n_prefix: int
    lengths: tuple[int, ...]  # document tokens of each sequence (the prefix not included), all >= 1
    tile: int
    n_reader: int = 0         # reader tokens after every document (the reader criterion), else 0
    starts: tuple[int, ...] = field(init=False)      # first row (the prefix's first token) of each sequence
    total: int = field(init=False)                   # rows of the pack
    pages: tuple[int, ...] = field(init=False)       # P = ceil(L / tile) per document
    la_nbytes: tuple[int, ...] = field(init=False)   # one head's LA vector, per document
    ca_nbytes: tuple[int, ...] = field(init=False)
    la_offsets: tuple[int, ...] = field(init=False)  # where each document's bytes start in a head's LA row
    ca_offsets: tuple[int, ...] = field(init=False)
    la_total: int = field(init=False)
    ca_total: int = field(init=False)

    def __post_init__(self):
        lengths = tuple(int(n) for n in self.lengths)
        if not lengths or min(lengths) < 1:
            raise ValueError(f"a pack needs at least one document and every document at least one token; got "
                             f"lengths {lengths[:8]}{'...' if len(lengths) > 8 else ''}")
        if self.n_prefix < 0 or self.n_reader < 0:
            raise ValueError(f"n_prefix={self.n_prefix} and n_reader={self.n_reader} must be >= 0")
        if self.tile not in TILES:
            raise ValueError(f"tile={self.tile} must be one of {', '.join(map(str, TILES))}")
        seq = [self.n_prefix + n + self.n_reader for n in lengths]
        la = tuple(la_nbytes(n, self.tile) for n in lengths)
        ca = tuple(ca_nbytes(n, self.tile) for n in lengths)
        derived = dict(lengths=lengths, starts=tuple(accumulate(seq, initial=0))[:-1], total=sum(seq),
                       pages=tuple(n_pages(n, self.tile) for n in lengths), la_nbytes=la, ca_nbytes=ca,
                       la_offsets=tuple(accumulate(la, initial=0))[:-1], ca_offsets=tuple(accumulate(ca, initial=0))[:-1],
                       la_total=sum(la), ca_total=sum(ca))
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """Sequence boundaries [0, end_0, end_1, ..., total] (varlen attention's offsets)."""
        return self.starts + (self.total,)

    @property
    def max_seqlen(self) -> int:
        return self.n_prefix + max(self.lengths) + self.n_reader

    def seq_rows(self, s: int) -> slice:
        """Rows of sequence s (prefix, document and reader)."""
        return slice(self.starts[s], self.starts[s] + self.n_prefix + self.lengths[s] + self.n_reader)

    def doc_rows(self, s: int) -> slice:
        """Rows of document s (its prefix excluded)."""
        return slice(self.starts[s] + self.n_prefix, self.starts[s] + self.n_prefix + self.lengths[s])

    def la_bytes(self, s: int) -> slice:
        return slice(self.la_offsets[s], self.la_offsets[s] + self.la_nbytes[s])

    def ca_bytes(self, s: int) -> slice:
        return slice(self.ca_offsets[s], self.ca_offsets[s] + self.ca_nbytes[s])
