"""The feature-head trainer's conventions match the drafter's: a head fitted on a tiny target's own text
agrees with it teacher-forced *and* gets drafts accepted when decoding."""

import torch

from mcsd import TreeDecoder
from mcsd.drafting.feature_draft import FeatureDrafter, FeatureHead, FeatureHeadConfig
from mcsd.train import feature_head as tfd


def _examples(target, n=12, length=40):
    """Greedy responses of the target with its hidden states and top-4, in target_data's record format."""
    dec = TreeDecoder(target, None, attention="sdpa")
    out = []
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        prompt = torch.randint(2, 64, (5,), generator=g)
        resp = torch.tensor(dec.generate_baseline(prompt, max_new_tokens=length, ignore_eos=True).tokens)
        seq = torch.cat([prompt, resp])[None]
        with torch.no_grad():
            o = target(seq, output_hidden_states=True)
        h = o.hidden_states[-1][0, len(prompt) - 1:len(prompt) - 1 + len(resp)]
        top = o.logits[0, len(prompt) - 1:len(prompt) - 1 + len(resp)].softmax(-1).topk(4, dim=-1)
        out.append({"prompt": prompt, "response": resp, "hidden": h, "topk_ids": top.indices,
                    "topk_probs": top.values})
    return out


def _fit(head, target, data, updates=150):
    """Train `head` on `data` with the trainer's own batches and loss; (step-1 top-1 before, agreement after)."""
    vocab = target.config.vocab_size
    head.vocab_ids = tfd.sub_vocabulary(data, 48, vocab)
    head.attach_lm_head(target.get_output_embeddings().weight)
    slot = torch.full((vocab,), -1, dtype=torch.long)
    slot[head.vocab_ids] = torch.arange(head.vocab_ids.numel())
    embed = target.get_input_embeddings()
    before = tfd.agreement(head, embed, data[:3], 64, "cpu")[0]["top1"]
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    items = tfd.windows(data, 64)
    for _ in range(updates):
        loss, _ = tfd.unrolled_loss(head, embed, *tfd.batch(data, items, 64, "cpu"), 3, slot, 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()
    return before, tfd.agreement(head, embed, data[:3], 64, "cpu")


def test_trained_head_agrees_and_is_accepted(target):
    torch.manual_seed(0)
    data = _examples(target)
    vocab = target.config.vocab_size
    cfg = FeatureHeadConfig(target_hidden=32, layers=1, heads=4, kv_heads=2, vocab_size=vocab, sub_vocab=48)
    head = FeatureHead(cfg)
    before, after = _fit(head, target, data)
    assert after[0]["top1"] > max(0.5, before + 0.2), (before, after)
    assert after[1]["top1"] > 0.3                        # step 2 reads the head's own predictions
    # the same head, used by the drafter at inference, gets its drafts accepted
    prompt = data[0]["prompt"]
    dec = TreeDecoder(target, FeatureDrafter(head, target), tree="2,1,1", policy="static", attention="sdpa")
    out = dec.generate(prompt, max_new_tokens=30, ignore_eos=True)
    assert out.tokens == data[0]["response"][:30].tolist()
    assert out.stats.mean_accepted > 1.5, out.stats.as_dict()


def test_v2_head_trains_on_fused_layers_and_is_accepted(target):
    """A v2 head (reading target layers 1 and 2, fused) learns from the trainer's v2 batches."""
    torch.manual_seed(0)
    data = _examples(target)
    for ex in data:                                   # the stored layers, as target_data's teacher stage writes them
        seq = torch.cat([ex["prompt"], ex["response"]])[None]
        with torch.no_grad():
            hs = target(seq, output_hidden_states=True).hidden_states
        p, r = len(ex["prompt"]), len(ex["response"])
        ex["layers"] = torch.cat([hs[1][0, p - 1:p - 1 + r], hs[2][0, p - 1:p - 1 + r]], dim=-1)
    vocab = target.config.vocab_size
    cfg = FeatureHeadConfig(target_hidden=32, layers=1, heads=4, kv_heads=2, vocab_size=vocab, sub_vocab=48,
                            feature_layers=(1, 2))
    head = FeatureHead(cfg)
    hid, inp, *_ = tfd.batch(data, [(0, 0)], 64, "cpu")
    assert inp.shape[-1] == 64 and torch.equal(hid[0, :40], data[0]["hidden"])
    _, after = _fit(head, target, data)
    assert after[0]["top1"] > 0.5, after
    dec = TreeDecoder(target, FeatureDrafter(head, target), tree="2,1,1", policy="static", attention="sdpa")
    out = dec.generate(data[0]["prompt"], max_new_tokens=30, ignore_eos=True)
    assert out.tokens == data[0]["response"][:30].tolist()
    assert out.stats.mean_accepted > 1.5


def test_teacher_forced_chains_are_what_decoding_accepts(target):
    """Greedy decoding with a static chain accepts, in the round rooted at response position t,
    exactly as many tokens as the trainer's teacher-forced chain from t gets right in a row:
    the trainer's inputs at depth >= 2, positions and cache are the drafter's. (The drafter reads
    one prompt position, as the trainer's windows over the response do.)"""
    torch.manual_seed(0)
    data = _examples(target, length=60)
    vocab = target.config.vocab_size
    cfg = FeatureHeadConfig(target_hidden=32, layers=1, heads=4, kv_heads=2, vocab_size=vocab, sub_vocab=48)
    head = FeatureHead(cfg)
    _, after = _fit(head, target, data, updates=60)
    assert after[0]["top1_given_prev"] == after[0]["top1"] and after[1]["positions_reached"] < after[1]["positions"]
    embed = target.get_input_embeddings()
    checked, accepted = 0, 0
    for ex in data[:4]:
        want = tfd.chain_lengths(head, embed, ex, steps=3)
        dec = TreeDecoder(target, FeatureDrafter(head, target, window=1), tree="1,1,1", policy="static",
                          attention="sdpa")
        out = dec.generate(ex["prompt"], max_new_tokens=60, ignore_eos=True)
        assert out.tokens == ex["response"].tolist()
        t = 0
        for a in out.stats.accepted_per_round:
            if t + 4 < len(ex["response"]):             # the chain and its bonus token fit in max_new_tokens
                assert a == int(want[t]), (t, a, want[t - 2:t + 3])
                checked += 1
                accepted += a
            t += a + 1
    assert checked > 30 and 0 < accepted < 3 * checked    # rounds of every kind were compared
    # the depth report's replay of decoding's roots from the chain lengths counts what decoding counts
    from mcsd.train import depth_report
    for ex in data[:4]:
        ex.setdefault("category", "writing")
    drafter = FeatureDrafter(head, target, window=1)
    assert depth_report.replayed(head, embed, data[:4], 3, max_new_tokens=60)["all"] == \
        depth_report.decoding(target, drafter, data[:4], 3, max_new_tokens=60, ignore_eos=True)["all"]


def test_depth_report_compares_both_sides_per_group(target):
    from mcsd.train import depth_report
    torch.manual_seed(0)
    data = _examples(target, n=6, length=30)
    for i, ex in enumerate(data):
        ex["category"] = ("writing", "math_reasoning")[i % 2]        # an MT-bench category, and a group of its own
    cfg = FeatureHeadConfig(target_hidden=32, layers=1, heads=4, kv_heads=2, vocab_size=target.config.vocab_size,
                            sub_vocab=48)
    head = FeatureHead(cfg)
    _fit(head, target, data, updates=30)
    result = depth_report.report(target, FeatureDrafter(head, target), target.get_input_embeddings(), data,
                                 max_new_tokens=30)
    for side in ("teacher_forced", "teacher_forced_at_rounds", "decoding"):
        assert {"all", "mt_bench", "math_reasoning"} <= set(result[side])
        assert [d["depth"] for d in result[side]["all"]] == [1, 2, 3]
        assert result[side]["all"][0]["reached"] > result[side]["all"][2]["reached"] > 0
    assert result["decoding"]["outputs_equal_to_stored"] == "6/6"        # exact: the target's own greedy text
    assert depth_report.differs(0.5, 4000, 0.6, 4000) and not depth_report.differs(0.5, 40, 0.6, 40)


def test_teacher_forced_measures_read_float32_features_with_a_bfloat16_head(target):
    """A depth report in bfloat16 loads the head in bfloat16 while the stored features are float32:
    the chains read them in the head's dtype, and agree with the float32 head's nearly everywhere."""
    torch.manual_seed(0)
    data = _examples(target, n=3, length=30)
    cfg = FeatureHeadConfig(target_hidden=32, layers=1, heads=4, kv_heads=2, vocab_size=target.config.vocab_size,
                            sub_vocab=48)
    head = FeatureHead(cfg)
    _fit(head, target, data, updates=30)
    embed = target.get_input_embeddings()
    full = [tfd.chain_lengths(head, embed, ex) for ex in data]
    half = FeatureHead(cfg)
    half.load_state_dict(head.state_dict())
    half.attach_lm_head(target.get_output_embeddings().weight)
    half = half.to(torch.bfloat16)
    embed16 = torch.nn.Embedding.from_pretrained(embed.weight.detach().to(torch.bfloat16))
    low = [tfd.chain_lengths(half, embed16, ex) for ex in data]
    assert all(a.shape == b.shape for a, b in zip(full, low))
    same = sum(int((a == b).sum()) for a, b in zip(full, low)) / sum(a.numel() for a in full)
    assert same > 0.8
    counted = [tfd.agreement(h, e, data, 64, "cpu")[0]["positions"] for h, e in ((half, embed16), (head, embed))]
    assert counted[0] == counted[1] > 0
