"""The seed papers' length policies (SVIP, DISCO, SpecDec++) are lossless, and refuse bad settings.

Each policy runs on tiny random models made here: greedy output must equal
plain greedy decoding token for token (float32; a "same" draft and a
"random" draft; chains and a tree), and sampled output must follow the
target's exact distribution (chi-square against enumeration of the first
three tokens). DISCO's classifier and SpecDec++'s head are small hand-made or
random models written here, not the shipped ones. Thresholds are chosen so
that each policy both drafts and stops in these runs; the tests check that it
did, so a policy that never cuts (or always cuts) fails.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from test_equivalence import perturbed

from mcsd import TreeDecoder
from mcsd.config import ConfigError
from mcsd.core.tree import TreeTopology
from mcsd.drafting.policies import POLICIES, make_policy
from mcsd.drafting.policies.disco import DISCO_FEATURES, DiscoClassifier
from mcsd.drafting.policies.specdecpp import AcceptanceHead, SpecDecHead
from mcsd.errors import ModelLoadError

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])
N_NEW = 48


class Recorder:
    """Counts a policy's per-node decisions (drafted / stopped) through its `expand`."""

    def __init__(self, policy):
        self.drafted = self.stopped = 0
        inner = policy.expand

        def expand(frontier):
            n = inner(frontier)
            n = frontier.max_children if n is None else n
            self.drafted += int((n > 0).sum())
            self.stopped += int((n == 0).sum())
            return n
        policy.expand = expand


@pytest.fixture(scope="module")
def pair():
    """A target with peaked next-token distributions and a draft that agrees about half the time."""
    target = tiny_llama(20, sharpness=30.0)
    return target, perturbed(target, 0.3)


@pytest.fixture(scope="module")
def small_pair():
    """Vocabulary 8, peaked enough that 600 runs fill the common three-token cells."""
    target = tiny_llama(10, vocab=8, layers=1, sharpness=25.0, hidden=16)
    return target, perturbed(target, 0.5, seed=3)


@pytest.fixture(scope="module")
def reference(pair):
    target = pair[0]
    out = target.generate(PROMPT[None], max_new_tokens=N_NEW, do_sample=False, attention_mask=torch.ones(1, 6))
    return out[0, PROMPT.numel():].tolist()


def disco_spec(top1_cut: float, threshold: float = 0.5) -> dict:
    """A hand-made DISCO classifier: P(continue) = sigmoid(20 (top1 - top1_cut))."""
    n = len(DISCO_FEATURES)
    coef = [0.0] * n
    coef[DISCO_FEATURES.index("top1")] = 20.0
    return {"format": "mcsd-disco-classifier", "version": 1, "features": list(DISCO_FEATURES), "kind": "logistic",
            "mean": [0.0] * n, "scale": [1.0] * n, "coef": coef, "intercept": -20.0 * top1_cut,
            "threshold": threshold}


def specdec_head(hidden: int, threshold: float = 0.5, drafter: str | None = "model", seed: int = 0) -> SpecDecHead:
    """A random acceptance head (its predictions spread over (0, 1))."""
    torch.manual_seed(seed)
    head = AcceptanceHead(hidden, layers=1)
    with torch.no_grad():
        head.out.weight.mul_(8.0)
    return SpecDecHead(head, threshold, drafter)


# Per policy: options that make it both draft and stop on `pair` (greedy) and on `small_pair` (sampling).
GREEDY_OPTIONS = {
    "svip": lambda draft: {"h": 0.49},
    "disco": lambda draft: {"model": DiscoClassifier(disco_spec(0.5))},
    "specdecpp": lambda draft: {"model": specdec_head(draft.config.hidden_size)},
}
SAMPLING_OPTIONS = {
    "svip": lambda draft: {"h": 0.453},
    "disco": lambda draft: {"model": DiscoClassifier(disco_spec(0.46))},
    "specdecpp": lambda draft: {"model": specdec_head(draft.config.hidden_size)},
}


def build(name, spec, draft, options):
    policy = make_policy(name, spec, **options(draft))
    return policy, Recorder(policy)


def exact_three_token_probs(model, prompt, vocab):
    """P(first three new tokens = (a, b, c)) under plain sampling at temperature 1: (vocab ** 3,)."""
    with torch.no_grad():
        p0 = model(prompt[None]).logits[0, -1].softmax(-1)
        two = torch.stack([torch.cat([prompt, torch.tensor([a])]) for a in range(vocab)])
        p1 = model(two).logits[:, -1].softmax(-1)                                           # (V, V)
        three = torch.stack([torch.cat([prompt, torch.tensor([a, b])]) for a in range(vocab) for b in range(vocab)])
        p2 = model(three).logits[:, -1].softmax(-1).view(vocab, vocab, vocab)
    return (p0[:, None, None] * p1[:, :, None] * p2).flatten()


def three_token_counts(decoder, n, vocab, prompt=(1, 2, 3)) -> torch.Tensor:
    """Counts of n seeded generations' first three tokens, (vocab ** 3,). Four new tokens, so the first
    round drafts up to three levels and the policies' decisions below the root count."""
    counts = torch.zeros(vocab ** 3)
    for seed in range(n):
        t = decoder.generate(torch.tensor(prompt), max_new_tokens=4, temperature=1.0, seed=seed).tokens
        counts[(t[0] * vocab + t[1]) * vocab + t[2]] += 1
    return counts


def chi_square_p(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """Goodness of fit of counts against exact probabilities; cells expecting fewer than 5 are pooled."""
    from scipy.stats import chisquare
    n = counts.sum()
    big = exact * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([exact[big], exact[~big].sum()[None]]) * n
    keep = expected > 0
    if bool((observed[~keep] > 0).any()):          # an outcome of probability zero
        return 0.0
    observed, expected = observed[keep], expected[keep]
    return float(chisquare(observed.numpy(), (expected * observed.sum() / expected.sum()).numpy()).pvalue)


@pytest.mark.parametrize("spec", ["1,1,1,1,1,1,1,1", "2,2,1,1"], ids=["chain", "tree"])
@pytest.mark.parametrize("draft_name", ["same", "random"])
@pytest.mark.parametrize("name", sorted(GREEDY_OPTIONS))
def test_greedy_equals_plain_greedy(pair, reference, name, draft_name, spec):
    target, noisy = pair
    draft = target if draft_name == "same" else noisy
    policy, rec = build(name, spec, draft, GREEDY_OPTIONS[name])
    out = TreeDecoder(target, draft, policy=policy, attention="sdpa").generate(PROMPT, max_new_tokens=N_NEW)
    assert out.tokens == reference
    assert rec.drafted > 0 and rec.stopped > 0            # the policy both drafted and cut branches
    if draft_name == "same":
        assert out.stats.mean_accepted > 1.0


@pytest.mark.parametrize("name", sorted(SAMPLING_OPTIONS))
def test_sampling_follows_the_target(small_pair, name):
    """Chi-square of 600 seeded runs against enumeration (reject at p < 0.001). The same counts
    against the draft's own distribution must be rejected: the check has the power to fail."""
    target, draft = small_pair
    policy, rec = build(name, "2,2,1", draft, SAMPLING_OPTIONS[name])
    dec = TreeDecoder(target, draft, policy=policy, attention="sdpa")
    counts = three_token_counts(dec, 600, target.config.vocab_size)
    prompt = torch.tensor([1, 2, 3])
    exact = exact_three_token_probs(target, prompt, target.config.vocab_size)
    assert counts[exact == 0].sum() == 0
    p = chi_square_p(counts, exact)
    assert p > 1e-3, f"chi-square p = {p:.2e}"
    assert chi_square_p(counts, exact_three_token_probs(draft, prompt, target.config.vocab_size)) < 1e-3
    assert rec.drafted > 0 and rec.stopped > 0


def test_registered_by_name():
    for name in ("svip", "disco", "specdecpp"):
        assert name in POLICIES and POLICIES[name].default_tree == "1,1,1,1,1,1,1,1"


# ---------------------------------------------------------------------------- SVIP

def test_svip_rule_on_hand_made_distributions():
    from mcsd.core.tree import DraftTree
    from mcsd.drafting.policies.base import Frontier
    topo = TreeTopology.from_spec("2,2")
    tree = DraftTree.root_only(topo, torch.tensor(0))
    peaked = torch.tensor([0.97, 0.01, 0.01, 0.01])              # H = 0.17 nats: sqrt(0.15 H) = 0.16
    flat = torch.full((4,), 0.25)                                # H = 1.39 nats: sqrt(0.15 H) = 0.46
    front = Frontier(1, torch.tensor([1, 2]), torch.tensor([2, 2]), torch.stack([peaked, flat]), tree)
    assert POLICIES["svip"](topo).expand(front).tolist() == [2, 0]
    assert POLICIES["svip"](topo, h=0.5).expand(front).tolist() == [2, 2]
    root = Frontier(0, torch.tensor([0]), torch.tensor([2]), flat[None], tree)
    assert POLICIES["svip"](topo).expand(root).tolist() == [2]                   # min_depth 1
    assert POLICIES["svip"](topo, min_depth=0).expand(root).tolist() == [0]


@pytest.mark.parametrize("options", [{"h": 0.0}, {"h": 1.5}, {"h": float("nan")}, {"h": "0.3"}, {"c": -1.0},
                                     {"c": 0}, {"min_depth": -1}, {"min_depth": 1.5}])
def test_svip_bad_settings(options):
    with pytest.raises(ConfigError):
        make_policy("svip", None, **options)


# ---------------------------------------------------------------------------- DISCO and SpecDec++ files

def test_disco_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "disco.json"
    path.write_text(json.dumps(disco_spec(0.5, threshold=0.7)))
    policy = make_policy("disco", None, model=path)
    assert policy.threshold == 0.7 and make_policy("disco", None, model=path, threshold=0.2).threshold == 0.2
    with pytest.raises(ModelLoadError, match="tools/train_disco.py"):
        make_policy("disco", None, model=tmp_path / "missing.json")
    for bad in ("{not json", json.dumps({"format": "other"}), json.dumps({**disco_spec(0.5), "coef": [1.0]}),
                json.dumps({**disco_spec(0.5), "threshold": 1.5}), json.dumps([1, 2])):
        path.write_text(bad)
        with pytest.raises(ModelLoadError, match="DISCO"):
            make_policy("disco", None, model=path)
    for threshold in (-0.1, 1.1, float("nan"), "high"):
        with pytest.raises(ConfigError):
            make_policy("disco", None, model=DiscoClassifier(disco_spec(0.5)), threshold=threshold)


def test_specdecpp_file_round_trip_and_errors(tmp_path, pair):
    target, noisy = pair
    head = specdec_head(noisy.config.hidden_size, threshold=0.4)
    head.head.save(tmp_path, 0.4, "model")
    loaded = SpecDecHead.load(tmp_path / "specdecpp.json")
    x = torch.randn(5, noisy.config.hidden_size)
    assert torch.allclose(loaded.predict(x), head.predict(x)) and loaded.threshold == 0.4
    with pytest.raises(ModelLoadError, match="tools/train_specdecpp.py"):
        make_policy("specdecpp", None, model=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text((tmp_path / "specdecpp.json").read_text())
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 64)                        # corrupt weights
    with pytest.raises(ModelLoadError, match="SpecDec"):
        make_policy("specdecpp", None, model=tmp_path / "bad.json")
    cfg = json.loads((tmp_path / "specdecpp.json").read_text())
    (tmp_path / "bad.safetensors").write_bytes((tmp_path / "specdecpp.safetensors").read_bytes())
    for change in ({"hidden": 7}, {"threshold": 0.0}, {"format": "x"}):
        (tmp_path / "bad.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ModelLoadError, match="SpecDec"):
            make_policy("specdecpp", None, model=tmp_path / "bad.json")
    with pytest.raises(ConfigError):
        make_policy("specdecpp", None, model=head, threshold=2.0)
    # a head trained for the feature drafter refuses a standalone draft model
    with pytest.raises(ConfigError, match="feature"):
        TreeDecoder(target, noisy, policy=make_policy("specdecpp", None, model=specdec_head(
            noisy.config.hidden_size, drafter="feature")), attention="sdpa")
    # a head of the wrong width is refused on the first round, with both widths named
    dec = TreeDecoder(target, noisy, policy=make_policy("specdecpp", None, model=specdec_head(8)), attention="sdpa")
    with pytest.raises(ConfigError, match="width 8"):
        dec.generate(PROMPT, max_new_tokens=8)


def test_specdecpp_reads_the_feature_drafters_predicted_features(pair, reference):
    from mcsd.drafting.feature_draft import FeatureDrafter, FeatureHead, FeatureHeadConfig
    target = pair[0]
    torch.manual_seed(0)
    head = FeatureHead(FeatureHeadConfig(target_hidden=32, hidden=32, heads=4, kv_heads=2, vocab_size=64)).eval()
    policy = make_policy("specdecpp", "2,1,1,1", model=specdec_head(32, drafter="feature"))
    rec = Recorder(policy)
    out = TreeDecoder(target, FeatureDrafter(head, target), policy=policy, attention="sdpa").generate(
        PROMPT, max_new_tokens=N_NEW)
    assert out.tokens == reference and rec.drafted > 0 and rec.stopped > 0


def test_unknown_setting_is_named():
    with pytest.raises(ConfigError, match="no setting 'hh'.*c, h, min_depth"):
        make_policy("svip", None, hh=0.3)


def test_cli_policy_options():
    from mcsd.cli.args import parse_policy_options
    assert parse_policy_options(["h=0.4", "min_depth=2", "post_verify=false", "model=a.json"]) == \
        {"h": 0.4, "min_depth": 2, "post_verify": False, "model": "a.json"}
    for bad in (["h"], ["=1"], ["a b=1"]):
        with pytest.raises(ConfigError, match="NAME=VALUE"):
            parse_policy_options(bad)


@pytest.mark.parametrize("policy, options", [("svip", ["h=0.9"]), ("pearl", ["post_verify=false"])])
def test_cli_runs_the_paper_methods(model_dirs, capsys, policy, options):
    from mcsd.cli import main
    common = ["--prompt", "w03 w17 w42 w05", "--max-new-tokens", "16", "--json"]
    pair = ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"), "--dtype", "float32"]
    assert main(pair + ["--policy", policy] + [f"--policy-option={o}" for o in options] + common) == 0
    run = json.loads(capsys.readouterr().out)
    assert main(["--target", str(model_dirs / "target"), "--dtype", "float32", "--baseline"] + common) == 0
    assert run["tokens"] == json.loads(capsys.readouterr().out)["tokens"]
    assert run["settings"]["policy"] == policy and run["settings"]["tree"] == POLICIES[policy].default_tree
    assert main(pair + ["--policy", policy, "--policy-option", "nope=1"] + common) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--policy-option nope: policy '{policy}' has no such setting" in err
