"""Cache commit: the accepted path's entries move down into the contiguous prefix, the rest is dropped."""

import torch
from transformers import DynamicCache

from mcsd.forward import kv_cache
from mcsd.forward.lm import CachedLM


def _filled_cache(n_layers=2, length=7):
    cache = DynamicCache()
    for layer in range(n_layers):
        # value at position t = 100 * layer + t, so every entry says where it came from
        pos = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1) + 100 * layer
        cache.update(pos.expand(1, 2, length, 3).clone(), -pos.expand(1, 2, length, 3).clone(), layer)
    return cache


def test_commit_moves_accepted_entries_and_truncates():
    cache = _filled_cache()
    # prefix of 3, then a 4-node tree at 3..6; keep nodes 0, 2, 3 (a root-to-leaf path)
    kv_cache.commit(cache, prefix_len=3, keep=torch.tensor([0, 2, 3]))
    assert kv_cache.cache_length(cache) == 6
    for layer in range(2):
        keys = cache.layers[layer].keys[0, 0, :, 0]
        values = cache.layers[layer].values[0, 1, :, 2]
        assert keys.tolist() == [100 * layer + t for t in (0, 1, 2, 3, 5, 6)]
        assert values.tolist() == [-(100 * layer + t) for t in (0, 1, 2, 3, 5, 6)]


def test_commit_of_root_only_and_truncate():
    cache = _filled_cache()
    kv_cache.commit(cache, prefix_len=4, keep=torch.tensor([0]))
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    kv_cache.truncate(cache, 2)
    assert kv_cache.cache_length(cache) == 2


def test_a_path_already_in_place_is_kept_without_copying():
    """A plain step or a chain accepted from its first nodes: the entries are where they belong,
    so commit only cuts the rest (no gather, no write)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    for keep, held in (([0, 1], [0, 1, 2, 3, 4, 5]), ([0], [0, 1, 2, 3, 4]), ([], [0, 1, 2, 3])):
        cache = _filled_cache()
        with Ops() as ops:
            kv_cache.commit(cache, prefix_len=4, keep=torch.tensor(keep, dtype=torch.long))
        assert not {"index_select", "copy_", "index_put_"} & set(ops.names)
        for layer in range(2):
            assert cache.layers[layer].keys[0, 0, :, 0].tolist() == [100 * layer + t for t in held]
            assert cache.layers[layer].values[0, 1, :, 2].tolist() == [-(100 * layer + t) for t in held]
    cache = _filled_cache()
    with Ops() as ops:
        kv_cache.commit(cache, prefix_len=4, keep=torch.tensor([1]))      # one that is not: moved
    assert "index_select" in ops.names
    assert cache.layers[1].keys[0, 0, :, 0].tolist() == [100, 101, 102, 103, 105]


def test_committed_cache_gives_the_same_logits_as_a_fresh_prefix(target):
    """After a tree forward and a commit, the next step's logits equal those of a plain run."""
    lm = CachedLM(target)
    lm.reset()
    prefix = torch.tensor([3, 17, 42, 5])
    lm.extend(prefix)
    # a 2-branch tree: root 9 -> (11, 12); 11 -> 13
    tokens = torch.tensor([9, 11, 12, 13])
    allowed = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    pos = torch.tensor([4, 5, 5, 6])
    tree_logits = lm.forward(tokens, pos, allowed)
    lm.commit(4, torch.tensor([0, 1, 3]))                       # accept 9, 11, 13
    nxt = lm.extend(torch.tensor([20]))[-1]
    with torch.no_grad():
        plain = target(torch.tensor([[3, 17, 42, 5, 9, 11, 13, 20]])).logits[0]
    assert torch.allclose(tree_logits[[0, 1, 3]], plain[4:7], atol=1e-5)
    assert torch.allclose(nxt, plain[-1], atol=1e-5)
    # the off-path sibling 12 saw only the root, exactly like a sequence [..., 9, 12]
    with torch.no_grad():
        sib = target(torch.tensor([[3, 17, 42, 5, 9, 12]])).logits[0, -1]
    assert torch.allclose(tree_logits[2], sib, atol=1e-5)
