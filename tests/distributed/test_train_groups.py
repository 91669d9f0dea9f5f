import json

from conftest import ROOT, torchrun


def test_only_the_current_and_previous_train_groups_are_kept(tmp_path, tiny_models):
    policy, _ = tiny_models
    torchrun(ROOT / "tests/workers/train_groups.py", policy, tmp_path, nproc=3)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    # every rank keeps the same groups, least recently used first: (0,1) is reused at the third step,
    # each new group evicts the oldest, and a step on the whole world keeps what was there
    expected = [[[0, 1]], [[0, 1], [1, 2]], [[1, 2], [0, 1]], [[0, 1], [0, 2]], [[0, 2], [0]], [[0, 2], [0]],
                [[0], [1, 2]]]
    assert all(r["kept"] == expected for r in results)
    # rank 0 made (0,1), (0,2) and (0) once each; both evicted ones are destroyed, (0) is alive
    assert results[0]["made"] == {"0,1": 1, "0,2": 1, "0": 1}
    assert (results[0]["destroyed"], results[0]["alive"]) == (2, 1)
    # rank 1 made (1,2) twice: destroyed at the fourth step, made again at the last
    assert results[1]["made"] == {"0,1": 1, "1,2": 2}
    assert (results[1]["destroyed"], results[1]["alive"]) == (2, 1)
    # every arrival in train, over a kept, remade or new group, loaded the stored state bit for bit
    assert [len(r["loads"]) for r in results] == [5, 5, 4]
    assert all(all(r["loads"]) for r in results)
