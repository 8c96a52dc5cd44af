"""The learned policy: features, JSON models (logistic and boosted trees), pruning and stopping, exactness."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mcsd import TreeDecoder
from mcsd.core.tree import DraftTree, TreeTopology
from mcsd.drafting.policies import FEATURE_NAMES, AcceptanceModel, LearnedPolicy
from mcsd.drafting.policies.acceptance import FORMAT, FORMAT_VERSION, candidate_features, export_sklearn
from mcsd.drafting.policies.base import Frontier, Gate
from mcsd.drafting.policies.learned import Costs
from mcsd.errors import ModelLoadError

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])


def constant_model(p: float) -> AcceptanceModel:
    """A logistic model that ignores its features: always predicts p (a DummyClassifier, as data)."""
    logit = float(np.log(p / (1 - p)))
    return AcceptanceModel({"format": FORMAT, "version": FORMAT_VERSION, "kind": "logistic",
                            "features": ["q_rank"], "mean": [0.0], "scale": [1.0], "coef": [0.0],
                            "intercept": logit})


def q_threshold_model(threshold: float) -> AcceptanceModel:
    """Predicts ~1 when the candidate's draft probability exceeds `threshold`, ~0 otherwise."""
    return AcceptanceModel({"format": FORMAT, "version": FORMAT_VERSION, "kind": "logistic",
                            "features": ["q_rank"], "mean": [threshold], "scale": [0.001], "coef": [1.0],
                            "intercept": 0.0})


def test_features_on_a_known_distribution():
    topo = TreeTopology.from_spec("3")
    tree = DraftTree.root_only(topo, torch.tensor(0))
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    fr = Frontier(0, torch.tensor([0]), torch.tensor([3]), probs, tree)
    x = candidate_features(fr, 3, torch.tensor([1.0]), recent=0.25)
    assert x.shape == (1, 3, len(FEATURE_NAMES))
    row = dict(zip(FEATURE_NAMES, x[0, 1].tolist()))
    assert row["q_rank"] == pytest.approx(0.3) and row["top1"] == pytest.approx(0.5)
    assert row["margin"] == pytest.approx(0.2) and row["rank"] == 1 and row["depth"] == 1
    assert row["entropy"] == pytest.approx(-(0.5 * np.log(0.5) + 0.3 * np.log(0.3) + 0.2 * np.log(0.2)), rel=1e-5)
    assert row["path_logp"] == pytest.approx(np.log(0.3), rel=1e-5)
    assert row["recent_accept"] == 0.25 and row["parent_pred"] == 1.0


def _policy(model, spec="3,2,2,1,1"):
    return LearnedPolicy(TreeTopology.from_spec(spec), model=model, costs=fixed(Costs.default()))


def fixed(costs: Costs) -> Costs:
    """Costs that measured rounds do not correct, so that decisions depend on the test's numbers alone."""
    costs.adapt = 0.0
    return costs


def probe_rounds(rounds: int) -> list[int]:
    """Rounds that draft when every probe loses: the first, then after waits of probe_every,
    twice that, ... (at most max_probe_gap) plain rounds."""
    out, gap, r = [0], LearnedPolicy.probe_every, 0
    while (r := r + gap + 1) < rounds:
        out.append(r)
        gap = min(2 * gap, LearnedPolicy.max_probe_gap)
    return out


@pytest.mark.parametrize("model", [constant_model(0.95), constant_model(0.001), q_threshold_model(0.02)],
                         ids=["confident", "hopeless", "q-threshold"])
@pytest.mark.parametrize("draft_name", ["same", "noisy"])
def test_learned_policy_is_lossless_greedy(target, random_draft, model, draft_name):
    from test_equivalence import perturbed
    draft = target if draft_name == "same" else perturbed(target, 0.3)
    ref = TreeDecoder(target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=60).tokens
    dec = TreeDecoder(target, draft, tree="3,2,2,1,1", policy=_policy(model), attention="sdpa")
    assert dec.generate(PROMPT, max_new_tokens=60).tokens == ref


def test_confident_model_grows_and_hopeless_model_stops(target):
    grow = TreeDecoder(target, target, policy=_policy(constant_model(0.95)), attention="sdpa")
    stop = TreeDecoder(target, target, policy=_policy(constant_model(0.001)), attention="sdpa")
    a = grow.generate(PROMPT, max_new_tokens=40).stats
    b = stop.generate(PROMPT, max_new_tokens=40).stats
    assert a.tree_nodes / a.rounds > 3 and a.mean_accepted > 2
    assert b.tree_nodes == 0 and b.mean_accepted == 1.0           # nothing is worth its verify cost
    # drafting loses every time it is tried, so the draft runs only in probe rounds, ever rarer: the first
    # round, then at most where doubling waits would probe (the probe budget only lengthens them)
    assert 1 <= b.draft_forwards <= len(probe_rounds(b.rounds)) < b.rounds // 4


def test_a_verify_curve_as_flat_as_amx_tiles_grows_trees_the_vnni_curve_keeps_small(target):
    """The policy sizes trees by the verify curve it is given, nothing hand-set: on AMX tiles' curve
    (16 rows 1.15x one, docs/results.md) it verifies several times the nodes a round that it does on
    AVX512-VNNI's (16 rows 3.8x one), for the same acceptance, and the text stays plain decoding's."""
    ref = TreeDecoder(target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=40).tokens
    curves = {"amx": {1: 7.35, 4: 7.56, 8: 7.93, 16: 8.47, 64: 20.0},
              "avx512vnni": {1: 4.49, 2: 4.85, 4: 5.55, 9: 10.79, 16: 17.08, 64: 60.0}}
    nodes = {}
    for isa, verify in curves.items():
        costs = fixed(Costs(verify=verify, draft={1: 0.3, 16: 0.4}, source="measured"))
        policy = LearnedPolicy(TreeTopology.from_spec("4,3,2,2,1"), model=constant_model(0.6), costs=costs)
        out = TreeDecoder(target, target, policy=policy, attention="sdpa").generate(PROMPT, max_new_tokens=40)
        assert out.tokens == ref
        nodes[isa] = out.stats.tree_nodes / out.stats.rounds
    assert nodes["amx"] >= 2 * nodes["avx512vnni"] > 0


def test_draft_gate_skips_rounds_and_stays_exact(target):
    """With a costly draft, losing rounds switch drafting off for a while; the
    draft catches up on the tokens it skipped and the output stays exact."""
    from test_equivalence import perturbed
    ref = TreeDecoder(target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=60).tokens
    costs = fixed(Costs(verify={1: 1.0, 64: 1.5}, draft={1: 0.5}))      # a draft step costs half a target step
    policy = LearnedPolicy(TreeTopology.from_spec("3,2,2,1,1"), model=q_threshold_model(0.02), costs=costs)
    policy.probe_budget = None                  # waits that only double: probes enough to accept some drafts
    dec = TreeDecoder(target, perturbed(target, 1.0, seed=4), policy=policy, attention="sdpa")
    calls = []
    begin = dec.drafter.begin_round
    dec.drafter.begin_round = lambda seq: (calls.append(len(seq)), begin(seq))[1]
    trees = []
    out = dec.generate(PROMPT, max_new_tokens=60, on_round=lambda tree, acc: trees.append(acc.n_accepted))
    assert out.tokens == ref
    skipped = out.stats.rounds - len(calls)
    assert skipped >= 5 and len(calls) >= 3 and sum(trees) > 0     # both kinds of round, some drafts accepted
    root_only = DraftTree.root_only(policy.topology, torch.tensor(3))

    def probes(budget, rounds=30):
        policy.probe_budget = budget
        policy.forget()
        policy.draft_value = -1.0               # as if drafting had been losing
        drafted = []
        for _ in range(rounds):
            drafted.append(policy.begin_round() > 0)
            policy.observe(0, root_only)        # nothing accepted: every probe loses
        return [i for i, d in enumerate(drafted) if d]

    assert probes(None) == [3, 10, 23]          # no budget: waits of 3, 6, 12 plain rounds
    # with a budget, a probe that lost L ms waits at least L / (budget x step) rounds: here each loses
    # the draft's step and the round's own price, and a step costs 1 ms
    step = costs.verify_ms(1)
    first = probes(0.05, 200)
    lost = -policy.draft_value
    assert first[0] == 3 and lost > 0.5
    waits = [b - a - 1 for a, b in zip(first, first[1:])]
    assert waits and all(w >= min(math.ceil(lost / (0.05 * step)), policy.max_probe_gap) for w in waits)
    assert probes(0.05, 200) == first           # a function of the costs and the tokens alone


def test_a_new_texts_first_round_is_weighed_whole():
    """A gate opened for a new text holds no worth yet: its first round's worth is the gate's value, not
    a mean with a round worth 0, so a first probe that loses L ms waits what L buys on the budget (half
    the wait, and twice the probes, otherwise); later rounds move the running mean."""
    gate = Gate(3, 256, budget=0.0025)
    assert gate.opens()
    gate.observe(-3.0, 6.0)
    assert gate.value == -3.0 and gate.gap == math.ceil(3.0 / (0.0025 * 6.0))
    assert sum(gate.opens() for _ in range(gate.gap)) == 0 and gate.opens()
    gate.observe(-1.0, 6.0)
    assert gate.value == pytest.approx(-2.0)                      # (1 - memory) x -3 + memory x -1
    gate.reset()
    gate.observe(2.0, 6.0)
    assert gate.value == 2.0 and gate.gap == 3 and gate.opens()


def test_the_draft_gate_credits_only_what_drafting_alone_brought():
    """Accepted drafted tokens that context drafting proposed too would have come without the draft:
    a round whose accepted tokens were all shared is worth what a round that accepted nothing is."""
    from types import SimpleNamespace

    from mcsd.decoding.propose import shared_prefix

    topo = TreeTopology.from_spec("2,1")
    tree = DraftTree.root_only(topo, torch.tensor(3))
    tree.append_level(torch.tensor([5, 6]), torch.tensor([0, 0]), torch.zeros(2), topo.child_table[0, :2])
    tree.append_level(torch.tensor([7]), torch.tensor([1]), torch.zeros(1), topo.child_table[tree.topo_ids[1], :1])
    values = {}
    for shared in (0, 1, 2):
        policy = LearnedPolicy(topo, model=constant_model(0.9), costs=fixed(Costs(verify={1: 10.0, 8: 12.0},
                                                                                  draft={1: 1.0})))
        assert policy.begin_round() > 0
        policy.observe(2, tree, shared=shared)
        values[shared] = policy.draft_value
    policy.forget()
    policy.begin_round()
    policy.observe(0, tree)
    assert values[0] > values[1] > values[2] == policy.draft_value
    assert values[0] - values[1] == pytest.approx(10.0)     # a token: one plain step (a first round: its own worth)

    def proposal(proposed, drafted_size=4):
        return SimpleNamespace(graft=SimpleNamespace(proposed=proposed), drafted=SimpleNamespace(size=drafted_size))

    path = [0, 1, 3, 5]                                               # two drafted nodes, then a grafted one
    assert shared_prefix(proposal({1: ["k"], 3: ["k"], 5: ["k"]}), path) == 2
    assert shared_prefix(proposal({3: ["k"]}), path) == 0              # beneath a node only the draft proposed
    assert shared_prefix(proposal({1: ["k"]}), path) == 1
    assert shared_prefix(SimpleNamespace(graft=None, drafted=SimpleNamespace(size=4)), path) == 0


@pytest.mark.parametrize("round_ms, drafts", [(0.0, True), (20.0, False)])
def test_a_first_level_that_cannot_beat_a_plain_step_drafts_nothing(round_ms, drafts):
    """The first level's nodes each pay for their own verify row (its choice alone would keep them), but
    where the rest of the round (its own work, the rows, one more level) costs more than their
    expected tokens, with the likeliest continued at the running acceptance, are worth in plain steps,
    the round drafts nothing more: the decoder runs the plain step, and the gate hears of a round that
    spent its first draft forward and its own work for nothing (its catch-up, the features read before
    it, the first level's decisions)."""
    topo = TreeTopology.from_spec("3,2,2")
    costs = fixed(Costs(verify={1: 10.0, 8: 12.0}, draft={1: 1.0}))
    costs.round_ms = round_ms
    policy = LearnedPolicy(topo, model=constant_model(0.3), costs=costs)
    assert policy.begin_round() > 0
    tree = DraftTree.root_only(topo, torch.tensor(0))
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    counts = policy.expand(Frontier(0, torch.tensor([0]), torch.tensor([3]), probs, tree))
    chosen = policy._choose(policy._last, 1)                  # what the nodes' own prices keep
    assert sum(chosen) >= 2
    assert int(counts.sum()) == (sum(chosen) if drafts else 0)
    if not drafts:
        policy.observe(0, tree)
        assert policy.draft_value == pytest.approx(-(costs.draft_ms(1) + round_ms))


def test_draft_gate_starts_afresh_each_generation(target):
    """A generation's trees never depend on the ones before it: once drafting has lost in one
    generation, the next one starts with the same gate (and so drafts the same rounds)."""
    ref = TreeDecoder(target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=40).tokens
    policy = _policy(constant_model(0.001))                 # nothing is worth drafting
    dec = TreeDecoder(target, target, policy=policy, attention="sdpa")
    first = dec.generate(PROMPT, max_new_tokens=40)
    second = dec.generate(PROMPT, max_new_tokens=40)
    assert first.tokens == second.tokens == ref
    assert 1 <= first.stats.draft_forwards <= len(probe_rounds(first.stats.rounds))   # the first round, probes
    assert second.stats.draft_forwards == first.stats.draft_forwards
    assert second.stats.accepted_per_round == first.stats.accepted_per_round


def test_a_gate_started_from_a_loss_waits_as_a_probe_that_lost_it_would():
    """`Gate.start_from`: a prior loss of L ms sits out at least L / (budget x step) rounds (within the
    longest wait), then a round runs and its own worth moves the mean; a prior gain leaves it open."""
    gate = Gate(3, 256, budget=0.0025)
    gate.start_from(-1.0, 8.0)                          # 1 ms / (0.0025 x 8 ms) = 50 rounds
    shut = 0
    while not gate.opens():
        shut += 1
    assert shut == gate.gap == 50 and gate.value == -1.0
    gate.observe(3.0, 8.0)                              # a round that gained: the mean of the two
    assert gate.value == pytest.approx(1.0) and gate.opens()
    gate.reset()
    gate.start_from(2.0, 8.0)
    assert gate.opens() and gate.value == 2.0
    gate.reset()
    gate.start_from(-100.0, 8.0)
    assert gate.rounds_shut() == 256


def test_learned_policy_sampling_is_exact():
    from conftest import assert_follows_target, tiny_llama
    from test_equivalence import perturbed

    from mcsd.config import SamplingConfig
    target = tiny_llama(10, vocab=8, layers=1, sharpness=6.0, hidden=16)
    dec = TreeDecoder(target, perturbed(target, 0.5, seed=3), policy=_policy(q_threshold_model(0.25), "3,2"),
                      attention="sdpa")
    assert_follows_target(dec, target, SamplingConfig(1.0), n=1200)


def shifted_model(p: float, temperatures, shifts) -> AcceptanceModel:
    """`constant_model(p)` with a `sampled` table of logit shifts."""
    spec = {"format": FORMAT, "version": FORMAT_VERSION, "kind": "logistic", "features": ["q_rank"],
            "mean": [0.0], "scale": [1.0], "coef": [0.0], "intercept": float(np.log(p / (1 - p))),
            "sampled": {"temperature": list(temperatures), "logit_shift": list(shifts)}}
    return AcceptanceModel(spec)


def test_the_sampled_table_shifts_the_logit_by_temperature():
    """Piecewise linear between the table's temperatures, its end values beyond them; no table, no shift."""
    m = shifted_model(0.5, [0.0, 0.5, 1.0], [0.0, -1.0, -3.0])
    assert [m.logit_shift(t) for t in (0.0, 0.25, 0.5, 0.75, 1.0, 2.0)] == [0.0, -0.5, -1.0, -2.0, -3.0, -3.0]
    assert shifted_model(0.5, [0.7], [-0.4]).logit_shift(0.0) == -0.4
    assert constant_model(0.5).logit_shift(1.0) == 0.0
    x = torch.zeros(4, len(FEATURE_NAMES))
    assert torch.allclose(m.predict_proba(x, m.logit_shift(1.0)), torch.sigmoid(torch.tensor(-3.0)).expand(4))
    assert torch.allclose(m.predict_proba(x), torch.full((4,), 0.5))


def test_the_policy_prices_nodes_for_the_generations_temperature(target):
    """A generation tells the policy its sampling settings: sampled at T 1, where the table says drafted
    nodes are rarely the target's draw, it drafts nothing after its first probe's level; greedy, the
    same model grows trees; the seeded text is the same whatever the table says."""
    from mcsd.config import SamplingConfig
    hopeless_sampled = shifted_model(0.95, [0.0, 0.5, 1.0], [0.0, -4.0, -12.0])
    dec = TreeDecoder(target, target, policy=_policy(hopeless_sampled), attention="sdpa")
    greedy = dec.generate(PROMPT, max_new_tokens=30).stats
    assert dec.policy.shift == 0.0 and greedy.tree_nodes / greedy.rounds > 2
    sampled = dec.generate(PROMPT, max_new_tokens=30, temperature=1.0, seed=5)
    assert dec.policy.shift == -12.0 and sampled.stats.tree_nodes == 0
    plain = TreeDecoder(target, target, policy=_policy(constant_model(0.95)), attention="sdpa")
    assert plain.generate(PROMPT, max_new_tokens=30, temperature=1.0, seed=5).tokens == sampled.tokens
    dec.policy.decoding(SamplingConfig(0.75))
    assert dec.policy.shift == -8.0


@pytest.mark.parametrize("kind", ["logistic", "gbt"])
def test_exported_sklearn_models_predict_like_sklearn(kind, tmp_path):
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, len(FEATURE_NAMES))).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 3] - x[:, 6] + rng.normal(scale=0.5, size=2000) > 0).astype(int)
    est = (make_pipeline(StandardScaler(), LogisticRegression()) if kind == "logistic"
           else GradientBoostingClassifier(n_estimators=30, max_depth=3))
    est.fit(x, y)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(export_sklearn(est)))
    ours = AcceptanceModel.load(path).predict_proba(torch.from_numpy(x)).numpy()
    theirs = est.predict_proba(x)[:, 1]
    assert np.mean(np.abs(ours - theirs) < 1e-4) > 0.99


@pytest.mark.parametrize("kind", ["logistic", "logistic on a subset", "gbt"])
def test_a_levels_acceptance_is_the_models_prediction_on_its_features(kind):
    """`level_proba` (a logistic model's score summed column by column, its scaler folded into the
    weights) and `level_rows` (the same on the host, in Python floats) predict what `predict_proba` does
    on `level_features`, for every column a model may read or leave out, on flat, peaked and filtered
    distributions, with and without a temperature's shift."""
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from mcsd.drafting.policies.acceptance import level_features
    rng = np.random.default_rng(1)
    names = list(FEATURE_NAMES) if kind != "logistic on a subset" else ["entropy", "rank", "q_rank", "depth"]
    x = rng.normal(size=(600, len(names))).astype(np.float32)
    y = (x[:, 0] - 0.7 * x[:, 2] + rng.normal(scale=0.5, size=600) > 0).astype(int)
    est = (GradientBoostingClassifier(n_estimators=10, max_depth=3) if kind == "gbt"
           else make_pipeline(StandardScaler(), LogisticRegression()))
    model = AcceptanceModel(export_sklearn(est.fit(x, y), feature_names=names))
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        f, k, v = 1 + trial % 3, 1 + trial % 4, (50, 8192)[trial % 2]
        probs = (torch.randn(f, v, generator=g) * (1 + trial)).softmax(-1)
        if trial % 3 == 0:
            probs[:, v // 3:] = 0                                          # a filtered distribution
        logp, parent = -5 * torch.rand(f, generator=g), torch.rand(f, generator=g)
        shift = 0.0 if trial % 2 else -0.43
        want = model.predict_proba(level_features(probs, logp, trial % 3, k, parent, 0.37), shift)
        got = model.level_proba(probs, logp, trial % 3, k, parent, 0.37, shift)
        assert got.shape == (f, k) and torch.allclose(got, want, rtol=0, atol=2e-6)
        rows = model.level_rows(probs, logp, trial % 3, k, parent.tolist(), 0.37, shift)
        assert torch.allclose(torch.tensor(rows, dtype=torch.float32), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("edit, fragment", [
    (lambda s: s.update(format="pickle"), "not an mcsd acceptance model"),
    (lambda s: s.update(version=99), "not an mcsd acceptance model"),
    (lambda s: s.update(features=["q_rank", "bogus"]), "unknown features"),
    (lambda s: s.update(coef=[1.0, 2.0]), "malformed acceptance model"),
    (lambda s: s.update(kind="neural"), "unknown model kind"),
    (lambda s: s.update(sampled={"temperature": [0.0, 1.0], "logit_shift": [0.0]}), "one logit shift per"),
    (lambda s: s.update(sampled={"temperature": [1.0, 0.5], "logit_shift": [0.0, 0.1]}), "must increase"),
    (lambda s: s.update(sampled={"temperature": [-1.0], "logit_shift": [0.0]}), "must increase from 0"),
    (lambda s: s.update(sampled={"temperature": [0.0], "logit_shift": [float("nan")]}), "shifts be finite"),
    (lambda s: s.update(sampled={"temperature": "hot"}), "malformed 'sampled' table"),
])
def test_tampered_models_are_refused(tmp_path, edit, fragment):
    spec = {"format": FORMAT, "version": FORMAT_VERSION, "kind": "logistic", "features": ["q_rank"],
            "mean": [0.0], "scale": [1.0], "coef": [1.0], "intercept": 0.0}
    edit(spec)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ModelLoadError, match=fragment):
        AcceptanceModel.load(path)
    path.write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelLoadError, match="cannot use acceptance model"):
        AcceptanceModel.load(path)


def test_missing_model_is_a_clear_cli_error(model_dirs, capsys, monkeypatch, tmp_path):
    from mcsd.cli import main
    monkeypatch.setenv("MCSD_MODELS_DIR", str(tmp_path))
    args = ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"), "--prompt", "w03",
            "--policy", "learned", "--dtype", "float32"]
    assert main(args) == 2
    assert "cannot use acceptance model" in capsys.readouterr().err


def test_no_tree_means_the_policys_own():
    from mcsd.drafting.policies import make_policy
    pol = make_policy("learned", None, model=constant_model(0.5), costs=Costs.default())
    assert pol.topology.max_depth == len(LearnedPolicy.default_tree.split(","))
    assert make_policy("static", None).topology.max_depth == 3            # 4,2,2


def test_a_drafter_ships_its_own_acceptance_model(model_dirs, target, tmp_path):
    """An `acceptance.json` in the drafter's folder replaces the generic model for that drafter
    (a feature head's folder and a standalone draft's alike); a model passed in is kept."""
    from conftest import word_tokenizer
    from test_feature_draft import random_head

    from mcsd import load_model_pair
    from mcsd.drafting.pair import cast_pair
    spec = {"format": FORMAT, "version": FORMAT_VERSION, "kind": "logistic", "features": ["q_rank"],
            "mean": [0.0], "scale": [1.0], "coef": [0.0], "intercept": -7.0}
    random_head(target).save(tmp_path / "head")
    (tmp_path / "head" / "acceptance.json").write_text(json.dumps(spec))
    t, drafter, _ = load_model_pair(str(model_dirs / "target"), str(tmp_path / "head"), dtype="float32")
    ref = TreeDecoder(t, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=30).tokens
    for d in (drafter, cast_pair(t, drafter, "float32")[1]):          # a cast drafter keeps its folder
        policy = LearnedPolicy(TreeTopology.from_spec("3,2,2"), costs=fixed(Costs.default()))
        out = TreeDecoder(t, d, policy=policy, attention="sdpa").generate(PROMPT, max_new_tokens=30)
        assert Path(policy.model_source) == (tmp_path / "head" / "acceptance.json").resolve()
        assert out.tokens == ref and out.stats.tree_nodes == 0        # its own model: nothing pays
    given = LearnedPolicy(TreeTopology.from_spec("3,2,2"), model=constant_model(0.95), costs=fixed(Costs.default()))
    out = TreeDecoder(t, drafter, policy=given, attention="sdpa").generate(PROMPT, max_new_tokens=30)
    assert given.model_source == "given" and out.tokens == ref and out.stats.tree_nodes > 0

    draft_dir = tmp_path / "draft"                                    # a standalone draft model's folder
    target.save_pretrained(draft_dir)
    word_tokenizer().save_pretrained(draft_dir)
    (draft_dir / "acceptance.json").write_text(json.dumps(spec))
    _, draft, _ = load_model_pair(str(model_dirs / "target"), str(draft_dir), dtype="float32")
    policy = LearnedPolicy(TreeTopology.from_spec("3,2,2"), costs=fixed(Costs.default()))
    TreeDecoder(t, draft, policy=policy, attention="sdpa")
    assert Path(policy.model_source).resolve() == (draft_dir / "acceptance.json").resolve()
    (draft_dir / "acceptance.json").write_text("{not json")           # a broken one is a clear error
    _, draft, _ = load_model_pair(str(model_dirs / "target"), str(draft_dir), dtype="float32")
    with pytest.raises(ModelLoadError, match="cannot use acceptance model"):
        TreeDecoder(t, draft, policy=LearnedPolicy(TreeTopology.from_spec("3,2,2")), attention="sdpa")
    assert LearnedPolicy(TreeTopology.from_spec("3,2,2")).model_source.endswith(
        "decision-models/acceptance.json")                            # no drafter bound yet: the generic model


def test_the_sampled_shift_fit_finds_the_shift_that_matches_acceptance():
    """fit_sampled_acceptance's arithmetic: a round's conditional probabilities back to logits (its
    path probabilities divided by its parents'), and the one shift whose expected accepted tokens are
    the accepted ones."""
    from mcsd.train.sampled_acceptance import expected, fit_shift, round_record
    topo = TreeTopology.from_spec("2,1")
    tree = DraftTree.root_only(topo, torch.tensor(0))
    tree.append_level(torch.tensor([5, 6]), torch.tensor([0, 0]), torch.zeros(2), topo.child_table[0, :2])
    tree.append_level(torch.tensor([7]), torch.tensor([1]), torch.zeros(1), topo.child_table[1, :1])
    path = [1.0, 0.8, 0.1, 0.8 * 0.5]
    parents, logits, accepted = round_record(tree, path, 0.0, 1)
    assert parents == [-1, 0, 0, 1] and accepted == 1
    assert logits[1:] == pytest.approx([math.log(4), math.log(1 / 9), 0.0], abs=1e-6)
    assert expected([(parents, logits, 1)], 0.0) == pytest.approx(0.8 + 0.1 + 0.4)
    # the same round recorded under a shift in force: the logits before it
    assert round_record(tree, path, -1.0, 1)[1][1:] == pytest.approx([math.log(4) + 1, math.log(1 / 9) + 1, 1.0])
    rounds = [(parents, logits, a) for a in (0, 1, 2, 1)]
    b = fit_shift(rounds)
    assert expected(rounds, b) == pytest.approx(4.0, abs=1e-3) and b < 0      # 4 accepted of 5.2 expected
    assert fit_shift([(parents, logits, 2)] * 3) > 0
