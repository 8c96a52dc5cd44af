"""The feature drafter: lossless with random weights, a sub-vocabulary, save/load, protocol wiring."""

import pytest
import torch
from conftest import assert_follows_target, tiny_llama

from mcsd import TreeDecoder
from mcsd.drafting.feature_draft import FeatureDrafter, FeatureHead, FeatureHeadConfig

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])


def random_head(target, sub_vocab=0, layers=1, seed=5):
    torch.manual_seed(seed)
    cfg = FeatureHeadConfig(target_hidden=target.config.hidden_size, hidden=16, layers=layers, heads=2, kv_heads=1,
                            vocab_size=target.config.vocab_size, sub_vocab=sub_vocab)
    head = FeatureHead(cfg).eval()
    if sub_vocab:
        head.vocab_ids = torch.randperm(cfg.vocab_size)[:sub_vocab].sort().values
    return head


@pytest.fixture(scope="module")
def reference(target):
    return TreeDecoder(target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=60).tokens


@pytest.mark.parametrize("spec", ["1,1,1", "4,2,2", "3,2,2,1"])
@pytest.mark.parametrize("sub_vocab", [0, 24])
def test_random_feature_head_is_lossless_greedy(target, reference, spec, sub_vocab):
    drafter = FeatureDrafter(random_head(target, sub_vocab), target)
    out = TreeDecoder(target, drafter, tree=spec, policy="static", attention="sdpa").generate(PROMPT, max_new_tokens=60)
    assert out.tokens == reference
    assert out.stats.draft_forwards > 0


def test_drafter_reads_true_target_features(target):
    """The head's first forward reads the target's own final hidden state at every prompt position."""
    head = random_head(target)
    drafter = FeatureDrafter(head, target)
    seen = []
    H = target.config.hidden_size
    dec = TreeDecoder(target, drafter, tree="1", policy="static", attention="sdpa")
    head.reduce.register_forward_pre_hook(lambda module, args: seen.append(args[0][..., :H].reshape(-1, H).clone()))
    dec.generate(PROMPT, max_new_tokens=3)
    with torch.no_grad():
        h = target(PROMPT[None], output_hidden_states=True).hidden_states[-1][0]
    assert seen[0].shape[0] == PROMPT.numel() and torch.allclose(seen[0], h, atol=1e-5)   # every prompt position


def test_sampling_with_sub_vocabulary_is_exact():
    from mcsd.config import SamplingConfig
    small = tiny_llama(10, vocab=8, layers=1, sharpness=6.0, hidden=16)
    drafter = FeatureDrafter(random_head(small, sub_vocab=5, seed=2), small)
    dec = TreeDecoder(small, drafter, tree="3,2", policy="static", attention="sdpa")
    assert_follows_target(dec, small, SamplingConfig(1.0), n=1200)


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, seed=3), dict(temperature=0.8, top_p=0.9, seed=4)])
def test_trees_over_a_sub_vocabulary_are_the_trees_over_the_whole_vocabulary(target, sampling, monkeypatch):
    """Growing a tree over the head's K scored tokens, candidates mapped back to their ids, drafts the very
    tree that scoring all V tokens (-inf outside) does: the same tokens under the same parents, round by
    round, greedy and under Gumbel sampling."""
    trees = {}
    for narrow in (True, False):
        drafter = FeatureDrafter(random_head(target, sub_vocab=24), target)
        assert drafter.vocab_ids is not None
        if not narrow:
            monkeypatch.setattr(FeatureDrafter, "vocab_ids", property(lambda self: None))
        seen = []
        dec = TreeDecoder(target, drafter, tree="4,2,2", policy="static", attention="sdpa")
        calls = []
        score = drafter._scores
        drafter._scores = lambda pred: (calls.append(score(pred).shape[-1]), score(pred))[1]
        out = dec.generate(PROMPT, max_new_tokens=40, **sampling,
                           on_round=lambda tree, acc: seen.append((tree.tokens.tolist(), tree.parents.tolist())))
        trees[narrow] = (seen, out.tokens)
        assert set(calls) == ({24} if narrow else {target.config.vocab_size})
        monkeypatch.undo()
    assert trees[True] == trees[False]
    assert len(trees[True][0]) > 3


def test_save_and_load_round_trip(target, tmp_path):
    head = random_head(target, sub_vocab=24, layers=2)
    head.save(tmp_path / "head", card={"note": "test"})
    loaded = FeatureHead.load(tmp_path / "head")
    assert torch.equal(loaded.vocab_ids, head.vocab_ids)
    for (k, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k.startswith("body.embed_tokens") or torch.equal(a, b), k     # the unused embedding is not saved
    (tmp_path / "head" / "feature_head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="does not hold a readable feature head"):
        FeatureHead.load(tmp_path / "head")


def test_load_pair_with_a_feature_head_directory(model_dirs, tmp_path, target):
    from mcsd import load_model_pair
    from mcsd.errors import ModelLoadError
    random_head(target, sub_vocab=24).save(tmp_path / "head")
    t, drafter, tok = load_model_pair(str(model_dirs / "target"), str(tmp_path / "head"), dtype="float32")
    assert isinstance(drafter, FeatureDrafter)
    ref = TreeDecoder(t, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=20).tokens
    dec = TreeDecoder(t, drafter, tree="2,2", policy="static", attention="sdpa")
    assert dec.generate(PROMPT, max_new_tokens=20).tokens == ref
    other = tiny_llama(3, hidden=48)
    random_head(other).save(tmp_path / "wrong")
    with pytest.raises(ModelLoadError, match="built for hidden size 48"):
        load_model_pair(str(model_dirs / "target"), str(tmp_path / "wrong"), dtype="float32")


def test_device_profile_times_a_feature_drafter(target, fresh_cache):
    """Tree policies get draft costs for a feature head too, cached under a key of its own (the cache
    starts empty: profiles key the architecture)."""
    from mcsd.costs.store import load_or_measure, profile_path
    from mcsd.costs.timing import measure
    from mcsd.decoding.calibration import device_costs
    drafter = FeatureDrafter(random_head(target), target, name="tiny-head")
    prof = measure(target, drafter, sizes=(1, 4), prefix_len=16, repeats=2, draft_sizes=(1, 2))
    assert set(prof.verify_ms) == {1, 4} and set(prof.draft_ms) == {1, 2}
    assert all(v > 0 for v in [*prof.verify_ms.values(), *prof.draft_ms.values()])
    assert prof.meta["draft"] == "feature-head:tiny-head"
    # costs follow the architecture: a head of another shape has a profile of its own, a same-shaped
    # head of another name shares this one's
    other = FeatureDrafter(random_head(target, layers=2), target, name="other-head")
    same = FeatureDrafter(random_head(target, seed=9), target, name="same-shape")
    assert profile_path(target, drafter) != profile_path(target, other) != profile_path(target, None)
    assert profile_path(target, drafter) == profile_path(target, same)
    uncalibrated = device_costs(target, drafter, calibrate=False)              # nothing cached, no measuring
    assert (uncalibrated.draft, uncalibrated.source) == ({1: 0.1, 8: 0.13, 32: 0.2}, "default")
    load_or_measure(target, drafter, sizes=(1, 4), prefix_len=16, repeats=1, draft_sizes=(1, 2))
    cached = device_costs(target, drafter)
    assert cached.draft.keys() == {1, 2} and cached.source == "cached"               # the cached profile
    assert device_costs(target, drafter, calibrate=True).source == "measured"    # measured again


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cost_measurement_of_a_feature_head(target, version):
    """tools/measure_draft.py --feature-head: interleaved 1-token timings over a fixed-length cache,
    the head reading the target layers it was built for."""
    from mcsd.train import measure as measure_draft
    drafter = FeatureDrafter(random_head(target) if version == "v1" else random_v2_head(target), target)
    context = list(range(3, 23))
    cost = measure_draft.measure_feature_cost(target, drafter, context, runs=3, warmup=1)
    assert cost["cache_len"] == 20 and cost["runs"] == 3
    assert cost["target_ms"] > 0 and cost["draft_ms"] > 0 and cost["ratio"] == pytest.approx(
        cost["draft_ms"] / cost["target_ms"], rel=0.01)
    assert drafter.cache.get_seq_length() == 19                  # the cache is back at its length after timing


# ---------------------------------------------------------------------------- v2: multi-layer features

def random_v2_head(target, layers=(1, -1), sub_vocab=0, seed=6):
    torch.manual_seed(seed)
    cfg = FeatureHeadConfig(target_hidden=target.config.hidden_size, hidden=16, layers=1, heads=2, kv_heads=1,
                            vocab_size=target.config.vocab_size, sub_vocab=sub_vocab, feature_layers=layers)
    head = FeatureHead(cfg).eval()
    if sub_vocab:
        head.vocab_ids = torch.randperm(cfg.vocab_size)[:sub_vocab].sort().values
    return head


@pytest.mark.parametrize("layers", [(0, 1, 2), (1, -1), (2,)])
@pytest.mark.parametrize("spec", ["1,1,1", "3,2,2,1"])
def test_random_v2_head_is_lossless_greedy(target, reference, layers, spec):
    drafter = FeatureDrafter(random_v2_head(target, layers), target)
    assert drafter.feature_layers == layers
    out = TreeDecoder(target, drafter, tree=spec, policy="static", attention="sdpa").generate(PROMPT, max_new_tokens=60)
    assert out.tokens == reference


def test_v2_head_reads_the_fused_chosen_layers(target):
    """The head's input at committed positions is fuse(concat of the chosen target layers)."""
    head = random_v2_head(target, (0, 2))
    drafter = FeatureDrafter(head, target)
    seen = []
    H = target.config.hidden_size
    head.reduce.register_forward_pre_hook(lambda module, args: seen.append(args[0][..., :H].reshape(-1, H).clone()))
    # uncalibrated: a profile measured here would feed forwards of its own through the head first
    TreeDecoder(target, drafter, tree="1", policy="static", attention="sdpa", calibrate=False).generate(
        PROMPT, max_new_tokens=3)
    with torch.no_grad():
        hs = target(PROMPT[None], output_hidden_states=True).hidden_states
        expected = head.fuse(torch.cat([hs[0][0], hs[2][0]], dim=-1))
    assert torch.allclose(seen[0], expected, atol=1e-5)


def test_v2_sampling_is_exact():
    from mcsd.config import SamplingConfig
    small = tiny_llama(10, vocab=8, layers=1, sharpness=6.0, hidden=16)
    drafter = FeatureDrafter(random_v2_head(small, (0, 1), sub_vocab=5, seed=2), small)
    dec = TreeDecoder(small, drafter, tree="3,2", policy="static", attention="sdpa")
    assert_follows_target(dec, small, SamplingConfig(1.0), n=1200)


def test_v2_save_load_and_bad_layers(target, tmp_path):
    from mcsd.config import ConfigError
    from mcsd.drafting.feature_draft import default_feature_layers
    head = random_v2_head(target, (0, 1, 2))
    head.save(tmp_path / "v2")
    loaded = FeatureHead.load(tmp_path / "v2")
    assert loaded.cfg.feature_layers == (0, 1, 2)
    assert torch.equal(loaded.fuse.weight, head.fuse.weight)
    with pytest.raises(ConfigError, match="reads target layers \\[0, 9\\], but the target has 2"):
        FeatureDrafter(random_v2_head(target, (0, 9)), target)
    assert default_feature_layers(30) == (2, 15, 27)
    assert default_feature_layers(2) == (1, 2)


def test_v1_head_widened_to_v2_drafts_as_before(target):
    """with_feature_layers: same draft distributions at every step, reading (0, -1) instead of the final state."""
    v1 = random_head(target, sub_vocab=24)
    v2 = v1.with_feature_layers((0, -1)).eval()
    assert v2.cfg.feature_layers == (0, -1) and v1.cfg.feature_layers == ()
    assert any(p.requires_grad for p in v2.parameters())
    outs = []
    for head in (v1, v2):
        drafter = FeatureDrafter(head, target)
        dec = TreeDecoder(target, drafter, tree="2,2,1", policy="static", attention="sdpa")
        record = []
        step = drafter.step
        drafter.step = lambda tree, rows: record.append(step(tree, rows).clone()) or record[-1]
        out = dec.generate(PROMPT, max_new_tokens=20)
        outs.append((out.tokens, record))
    assert outs[0][0] == outs[1][0]
    assert len(outs[0][1]) == len(outs[1][1]) > 0
    for a, b in zip(outs[0][1], outs[1][1]):
        assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="include -1"):
        v1.with_feature_layers((0, 1))
    with pytest.raises(ValueError, match="already reads"):
        v2.with_feature_layers((0, -1))


def test_drafter_keeps_only_the_features_it_will_read(target):
    """Features of positions already in the head's cache are dropped; new ones are fused once per
    drafted round, not copied with the whole history every round."""
    drafter = FeatureDrafter(random_v2_head(target, (0, -1)), target)
    out = TreeDecoder(target, drafter, tree="1,1", policy="static", attention="sdpa").generate(PROMPT, max_new_tokens=40)
    held = drafter._features.shape[0] + sum(h.shape[0] for h in drafter._pending)
    assert drafter._first > len(PROMPT) and held <= 4
    assert drafter._first + held >= len(PROMPT) + len(out.tokens) - 1


def test_window_reads_the_prompt_tail_and_stays_aligned(target, reference):
    """window=3: the head's first forward reads the prompt's last 3 positions only; every later
    catch-up reads the true features of the positions it names, at the cache index they belong."""
    from mcsd.forward import kv_cache
    drafter = FeatureDrafter(random_head(target), target, window=3)
    reads, in_begin = [], []
    run, begin = drafter._run, drafter.begin_round

    def recording_run(feats, tokens, positions, allowed):
        if in_begin:
            reads.append((feats.clone(), positions.clone(), kv_cache.cache_length(drafter.cache)))
        return run(feats, tokens, positions, allowed)

    def recording_begin(sequence):
        in_begin.append(True)
        try:
            return begin(sequence)
        finally:
            in_begin.clear()
    drafter._run, drafter.begin_round = recording_run, recording_begin
    out = TreeDecoder(target, drafter, tree="2,1", policy="static", attention="sdpa").generate(
        PROMPT, max_new_tokens=60)
    assert out.tokens == reference
    seq = torch.cat([PROMPT, torch.tensor(out.tokens)])
    with torch.no_grad():
        h = target(seq[None], output_hidden_states=True).hidden_states[-1][0]
    offset = len(PROMPT) - 3                        # the first round's t_end is len(PROMPT)
    assert reads[0][1].tolist() == [offset + 1, offset + 2, offset + 3] and reads[0][2] == 0
    assert len(reads) > 10
    for feats, positions, cached in reads:
        start = int(positions[0]) - 1
        assert start == cached + offset             # cache index + offset = position
        assert torch.allclose(feats, drafter.head.fused(h[start:start + len(feats)]), atol=1e-4)


def test_features_from_a_position_inside_a_later_observed_block(target):
    """The rows before `start` are dropped across the blocks observed since the last read (a prompt's
    states, then single steps' and a verify's path): what is fused is exactly the rows from `start`."""
    drafter = FeatureDrafter(random_head(target), target)
    width = drafter.head.cfg.target_hidden * len(drafter.feature_layers)
    blocks = [torch.randn(n, width) for n in (4, 1, 3, 2)]
    for block in blocks:
        drafter.observe_target(block)
    with torch.inference_mode():
        got = drafter.features_from(6)
        assert torch.allclose(got, drafter.head.fused(torch.cat(blocks)[6:]), atol=1e-6) and len(got) == 4
        assert torch.equal(drafter.features_from(8), got[2:])           # read before: kept, not fused again


def test_window_bounds_are_checked(target):
    from mcsd.config import ConfigError
    with pytest.raises(ConfigError, match="window"):
        FeatureDrafter(random_head(target), target, window=0)
    assert FeatureDrafter(random_head(target), target).window == 64


def test_a_head_on_another_device_than_the_target_is_one_clear_error(target):
    from mcsd.config import ConfigError
    head = random_head(target).to("meta")                  # any device but the target's (cpu here)
    with pytest.raises(ConfigError, match="feature head's weights are on meta, the target's on cpu: move the head"):
        FeatureDrafter(head, target)
