import json

import torch

from conftest import ROOT, torchrun
from storage import plan_layout


def test_layout_is_aligned_and_disjoint():
    slots, total = plan_layout([("a", (3,), torch.float32), ("b", (5, 2), torch.bfloat16), ("c", (1,), torch.int64)])
    assert [s.offset % 64 for s in slots] == [0, 0, 0]
    ends = [s.offset + s.nbytes for s in slots]
    assert all(end <= nxt.offset for end, nxt in zip(ends, slots[1:]))
    assert slots[0].offset >= 8 and total >= ends[-1]


def test_two_local_ranks_share_one_copy(tmp_path):
    torchrun(ROOT / "tests/workers/storage_share.py", tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"versions_seen": [1, 2]}
