"""Fit DISCO's continue-or-stop classifier on fitting-split traces and pick its threshold for speed.

    python tools/collect_traces.py --drafter feature --split fit --tree 3,2,1,1,1,1,1,1 \\
        --out ~/.cache/mcsd/traces/fit-chain
    python tools/collect_traces.py --drafter feature --split heldout --tree 3,2,1,1,1,1,1,1 \\
        --out ~/.cache/mcsd/traces/heldout-chain
    python tools/train_disco.py --fit ~/.cache/mcsd/traces/fit-chain --heldout ~/.cache/mcsd/traces/heldout-chain \\
        --profile ~/.cache/mcsd/profiles/<pair>.json

One row per (frontier node f, its rank-0 child c) of the traced trees: the
features `mcsd.drafting.policies.disco.DISCO_FEATURES` of f, and the oracle label "c
is on the accepted path" (greedy acceptance of c and all its ancestors).
A standardised logistic regression (scikit-learn) is fitted on the fitting
split. The threshold is the one, on a grid, that maximises simulated tokens
per second when the fitting split's rounds are replayed as chains (verify
and draft costs from a device profile written by mcsd.costs.profile; generic costs
without one). Held-out AUC and simulated figures against every static chain
length go into the card. Output: `disco.json` (plain JSON parameters) and
`disco-card.json`, under models/decision-models by default.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from mcsd.drafting.policies.disco import DISCO_FEATURES, FORMAT, FORMAT_VERSION, DiscoClassifier
from mcsd.loading.cache import models_dir
from mcsd.train import portable
from mcsd.train.decision_models import load_traces, trace_command
from mcsd.train.length_data import (
    COL,
    ChainCosts,
    auc_or_none,
    chains,
    drafted_from_decisions,
    path_labels,
    simulate,
    static_table,
)

MAX_DEPTH = 8
GRID = np.round(np.arange(0.02, 0.96, 0.02), 2)


def decision_rows(data: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per round, the chain decisions at depth 0..MAX_DEPTH-1.

    Returns:
        x: (R, MAX_DEPTH, len(DISCO_FEATURES)) features of the frontier node deciding on the chain's next node;
        path_ok: (R, MAX_DEPTH) 1 where the chain's node at that depth + 1 is on the accepted path;
        valid: (R, MAX_DEPTH) the trace reached that depth.
    """
    f = data["features"]
    parent = data["parent_row"]
    path = path_labels(data["label_greedy"], parent)
    rows = chains(data, MAX_DEPTH)                                    # (R, D) the child c of each decision
    valid = rows >= 0
    c = np.maximum(rows, 0)
    par = parent[c]
    q_own = np.where(par >= 0, f[np.maximum(par, 0), COL["q_rank"]], 1.0)
    top1 = f[c, COL["top1"]]
    x = np.stack([q_own, top1, top1 - f[c, COL["margin"]], f[c, COL["entropy"]], f[c, COL["depth"]] - 1.0], -1)
    return x, np.where(valid, path[c], 0.0), valid


def choose_threshold(prob: np.ndarray, path_ok, valid, costs, min_depth: int = 1):
    scores = {}
    for t in GRID:
        drafted = drafted_from_decisions((prob >= t) & valid, min_depth)
        scores[float(t)] = simulate(drafted, path_ok, costs, MAX_DEPTH)
    best = max(scores, key=lambda t: scores[t]["tokens_per_s"])
    return best, scores


def roc_threshold(y: np.ndarray, p: np.ndarray) -> float:
    """Hugging Face's refit rule for comparison: the ROC point minimising FPR + 3 FNR."""
    from sklearn.metrics import roc_curve
    fpr, tpr, thr = roc_curve(y, p)
    i = int(np.argmin(fpr + 3 * (1 - tpr)))
    return float(min(max(thr[i], 0.0), 1.0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", type=Path, required=True, help="trace folder of the fitting split")
    ap.add_argument("--heldout", type=Path, required=True, help="trace folder of the held-out split")
    ap.add_argument("--profile", type=Path, default=None, help="device profile JSON for the simulated costs")
    ap.add_argument("--out", type=Path, default=None, help="folder (default models/decision-models)")
    args = ap.parse_args(argv)
    from sklearn.linear_model import LogisticRegression

    costs = ChainCosts.load(args.profile)
    fit, held = load_traces(args.fit), load_traces(args.heldout)
    x_fit, ok_fit, valid_fit = decision_rows(fit)
    x_held, ok_held, valid_held = decision_rows(held)
    xf, yf = x_fit[valid_fit], ok_fit[valid_fit]
    mean, scale = xf.mean(0), xf.std(0) + 1e-6
    clf = LogisticRegression(max_iter=2000).fit((xf - mean) / scale, yf > 0.5)
    spec = {"format": FORMAT, "version": FORMAT_VERSION, "features": list(DISCO_FEATURES), "kind": "logistic",
            "mean": mean.tolist(), "scale": scale.tolist(), "coef": clf.coef_[0].tolist(),
            "intercept": float(clf.intercept_[0]), "threshold": 0.5}
    model = DiscoClassifier(spec, "export")

    import torch
    prob_fit = model.predict_proba(torch.tensor(x_fit, dtype=torch.float32)).numpy()
    prob_held = model.predict_proba(torch.tensor(x_held, dtype=torch.float32)).numpy()
    threshold, grid = choose_threshold(prob_fit, ok_fit, valid_fit, costs)
    spec["threshold"] = threshold
    drafted_held = drafted_from_decisions((prob_held >= threshold) & valid_held, 1)
    held_sim = simulate(drafted_held, ok_held, costs, MAX_DEPTH)
    statics = static_table(ok_held, valid_held, costs, MAX_DEPTH)
    best_k = max(statics, key=lambda k: statics[k]["tokens_per_s"])
    y_held = ok_held[valid_held] > 0.5
    card = {
        "what": "DISCO continue-or-stop classifier (P(next chain token on the accepted path)) for the disco policy",
        "paper": "Mamou et al. 2024, arXiv 2405.04304",
        "features": list(DISCO_FEATURES), "classifier": "StandardScaler + LogisticRegression (scikit-learn)",
        "label": "oracle: the rank-0 child lies on the greedy-accepted path",
        "threshold": threshold, "threshold_rule": "max simulated tokens/s on the fitting split's chains",
        "threshold_roc_fpr_plus_3fnr": roc_threshold(yf > 0.5, prob_fit[valid_fit]),
        "metrics_heldout": {"auc": auc_or_none(y_held, prob_held[valid_held]),
                            "rows": int(valid_held.sum()), "base_rate": float(y_held.mean()),
                            "simulated_disco": held_sim, "simulated_best_static": {"k": best_k, **statics[best_k]},
                            "simulated_static": statics},
        "simulated_fit_by_threshold": {str(t): v for t, v in grid.items()},
        "costs": costs.as_dict(),
        "data": {"fit": {"rows": int(valid_fit.sum()), "rounds": int(len(ok_fit)),
                         "questions": int(len(np.unique(fit["question_id"]))),
                         "command": trace_command(fit["settings"], args.fit)},
                 "heldout": {"rows": int(valid_held.sum()), "rounds": int(len(ok_held)),
                             "questions": int(len(np.unique(held["question_id"]))),
                             "command": trace_command(held["settings"], args.heldout)}},
        "command": "python tools/train_disco.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    spec["meta"] = {"trained_on": card["data"]["fit"]["command"], "drafter": fit["settings"].get("drafter")}
    out = args.out or models_dir() / "decision-models"
    out.mkdir(parents=True, exist_ok=True)
    DiscoClassifier(spec, "export")                                   # what is written must load
    (out / "disco.json").write_text(json.dumps(spec, indent=1))
    (out / "disco-card.json").write_text(json.dumps(portable(card), indent=1))
    print(f"DISCO: held-out AUC {card['metrics_heldout']['auc']}, threshold {threshold}; simulated held-out "
          f"tau {held_sim['tau']:.2f}, {held_sim['tokens_per_s']:.1f} tok/s vs best static k={best_k} "
          f"{statics[best_k]['tokens_per_s']:.1f} tok/s -> {out}")
    return 0
