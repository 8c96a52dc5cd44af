"""Traces with draft hidden states -> DISCO classifier and SpecDec++ head -> policies that load them, end to end."""

import json

import numpy as np
import torch
from test_trace_tools import collect_fit_and_heldout

from mcsd import TreeDecoder
from mcsd.drafting.policies import make_policy
from mcsd.train import disco as train_disco
from mcsd.train import specdecpp as train_specdecpp
from mcsd.train.length_data import ChainCosts, chains, drafted_from_decisions, path_labels


def test_path_labels_chains_and_drafted_lengths():
    # one round: root children rows 0 (rank 0) and 1 (rank 1); row 2 under row 0; row 3 under row 2
    data = {"features": np.zeros((4, 9)), "parent_row": np.array([-1, -1, 0, 2])}
    data["features"][:, 6] = [0, 1, 0, 0]                                   # the rank column
    assert chains(data, 4).tolist() == [[0, 2, 3, -1]]
    assert path_labels(np.array([1, 1, 0, 1]), data["parent_row"]).tolist() == [1, 1, 0, 0]
    go = np.array([[False, True, False, True], [True, True, True, False]])
    assert drafted_from_decisions(go, 1).tolist() == [2, 3]                 # the first decision is forced on


def test_chain_costs_are_the_faster_path_per_size(tmp_path):
    """A profile timed on both matmul paths gives the thresholds the costs the engine runs at."""
    from mcsd.costs.profile import DeviceProfile
    prof = DeviceProfile(verify_ms={1: 40.0, 2: 41.0, 8: 42.0, 32: 60.0}, draft_ms={1: 4.0, 2: 4.5},
                         verify_aten_ms={1: 25.0, 2: 32.0, 8: 70.0}, draft_aten_ms={1: 2.5, 2: 5.0})
    (tmp_path / "p.json").write_text(prof.to_json())
    costs = ChainCosts.load(tmp_path / "p.json")
    assert costs.sizes.tolist() == [1, 2, 8, 32]
    assert costs.verify.tolist() == [25.0, 32.0, 42.0, 60.0]
    assert costs.draft == 2.5
    assert ChainCosts.load(None).source == "generic"


def test_collect_train_and_use(model_dirs, tmp_path, target):
    noisy, _ = collect_fit_and_heldout(model_dirs, tmp_path, target, ["--tree", "2,1,1,1", "--hidden"])
    with np.load(tmp_path / "fit" / "shard-00000.npz") as z:
        hidden, valid, depth = z["hidden"], z["hidden_valid"], z["features"][:, 4]
    assert hidden.shape[1] == noisy.config.hidden_size
    assert not valid[depth == 4].any()                  # the deepest level is never read by the draft
    assert valid[depth < 4].mean() > 0.9                # the rest is (but the last level of a short final round)
    assert np.abs(hidden[valid > 0]).sum(1).min() > 0

    out = tmp_path / "dm"
    folders = ["--fit", str(tmp_path / "fit"), "--heldout", str(tmp_path / "held"), "--out", str(out)]
    assert train_disco.main(folders) == 0
    assert train_specdecpp.main(folders + ["--epochs", "1"]) == 0
    for card in ("disco-card.json", "specdecpp-card.json"):
        c = json.loads((out / card).read_text())
        assert 0 < c["threshold"] <= 1 and "collect_traces.py" in c["data"]["fit"]["command"]
    assert json.loads((out / "specdecpp.json").read_text())["drafter"] == "model"

    prompt = torch.tensor([3, 17, 42, 5, 9, 11])
    ref = TreeDecoder(target, None, attention="sdpa").generate_baseline(prompt, max_new_tokens=30).tokens
    for name, model in (("disco", out / "disco.json"), ("specdecpp", out / "specdecpp.json")):
        dec = TreeDecoder(target, noisy, policy=make_policy(name, "1,1,1,1", model=model), attention="sdpa")
        assert dec.generate(prompt, max_new_tokens=30).tokens == ref
