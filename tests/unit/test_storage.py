"""storage.py's layout and the arithmetic of its copies: aligned disjoint regions, FSDP2's row shards, and
the pieces a copy is cut into (the storage on real ranks and nodes: tests/distributed/test_storage_replicas.py)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import layout, pieces, shard_rows


def test_layout_is_aligned_and_disjoint():
    regions, total = layout([("a", (3,), torch.float32), ("b", (5, 2), torch.bfloat16), ("c", (1,), torch.int64)])
    assert [s.offset % 64 for s in regions] == [0, 0, 0]
    ends = [s.offset + s.nbytes for s in regions]
    assert all(end <= nxt.offset for end, nxt in zip(ends, regions[1:]))
    assert regions[0].offset >= 8 and total >= ends[-1]


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 300), count=st.integers(1, 16))
def test_shard_rows_match_fsdp2s_chunking(rows, count):
    chunks = torch.arange(rows).chunk(count) if rows else ()
    for index in range(count):
        first, stop = shard_rows(rows, index, count)
        expected = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(first, stop)) == expected


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), max_size=8), limit=st.integers(1, 40))
def test_pieces_cover_every_byte_once_within_the_limit(sizes, limit):
    cut = list(pieces(sizes, limit))
    assert all(0 < sum(stop - start for _, start, stop in piece) <= limit for piece in cut)
    assert all(sum(stop - start for _, start, stop in piece) == limit for piece in cut[:-1])
    laid_out = [(run, byte) for piece in cut for run, start, stop in piece for byte in range(start, stop)]
    assert laid_out == [(run, byte) for run, size in enumerate(sizes) for byte in range(size)]
