"""Train SpecDec++'s acceptance head on traced draft hidden states and pick its stopping threshold h.

    python tools/collect_traces.py --drafter feature --split fit --hidden --tree 3,2,1,1,1,1,1,1 \\
        --out ~/.cache/mcsd/traces/fit-chain
    python tools/collect_traces.py --drafter feature --split heldout --hidden --tree 3,2,1,1,1,1,1,1 \\
        --out ~/.cache/mcsd/traces/heldout-chain
    python tools/train_specdecpp.py --fit ~/.cache/mcsd/traces/fit-chain --heldout ~/.cache/mcsd/traces/heldout-chain \\
        --profile ~/.cache/mcsd/profiles/<pair>.json

Rows: every traced node the draft read (so it has a hidden state), with the
soft label min(1, p/q) the trace recorded (p the target's, q the draft's
probability of the node's token, temperature 1). Loss: binary cross-entropy
on the soft label, the rejection term weighted `--reject-weight` (6, as in
the paper). The head is a residual MLP (`mcsd.drafting.policies.specdecpp.AcceptanceHead`).
h is chosen on a grid (0.05-0.99) by simulated tokens per second of the
fitting split's rounds replayed as chains (costs from a device profile).
Output: `specdecpp.safetensors` + `specdecpp.json` (no pickles) and
`specdecpp-card.json`, under models/decision-models by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from mcsd.drafting.policies.specdecpp import AcceptanceHead, SpecDecHead
from mcsd.loading.cache import models_dir
from mcsd.train import portable
from mcsd.train.decision_models import load_traces, trace_command
from mcsd.train.length_data import (
    ChainCosts,
    auc_or_none,
    chains,
    drafted_from_decisions,
    path_labels,
    simulate,
    static_table,
)

MAX_DEPTH = 8
GRID = np.round(np.concatenate([np.arange(0.05, 0.9, 0.05), [0.9, 0.92, 0.94, 0.96, 0.97, 0.98, 0.99]]), 2)


def weighted_bce(logits: torch.Tensor, soft: torch.Tensor, reject_weight: float) -> torch.Tensor:
    """Mean of -[y log s + w (1 - y) log(1 - s)] for soft labels y, s = sigmoid(logits)."""
    logsig = torch.nn.functional.logsigmoid
    return -(soft * logsig(logits) + reject_weight * (1 - soft) * logsig(-logits)).mean()


def train(x: torch.Tensor, y: torch.Tensor, layers: int, epochs: int, reject_weight: float, seed: int = 0,
          lr: float = 1e-3, batch: int = 1024) -> AcceptanceHead:
    torch.manual_seed(seed)
    head = AcceptanceHead(x.shape[1], layers)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * ((len(x) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    for _ in range(epochs):
        order = torch.randperm(len(x))
        for i in range(0, len(x), batch):
            idx = order[i:i + batch]
            loss = weighted_bce(head(x[idx]), y[idx], reject_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return head.eval()


@torch.no_grad()
def predict(head: AcceptanceHead, hidden: np.ndarray) -> np.ndarray:
    out = [torch.sigmoid(head(torch.from_numpy(hidden[i:i + 8192].astype(np.float32)))) for i in
           range(0, len(hidden), 8192)]
    return torch.cat(out).numpy() if out else np.zeros(0)


def chain_survival(data: dict, accept: np.ndarray):
    """Each round's rank-0 chain with the head's predictions, for replaying SpecDec++'s rule.

    Returns (survive (R, D): predicted probability that the nodes at depth 1..j+1 are all
    accepted, path_ok (R, D), valid (R, D))."""
    rows = chains(data, MAX_DEPTH)
    valid = rows >= 0
    path = path_labels(data["label_greedy"], data["parent_row"])
    c = np.maximum(rows, 0)
    a = np.where(valid & (data["hidden_valid"][c] > 0), accept[c], 0.0)          # acceptance of the node at depth j+1
    return np.cumprod(a, axis=1), np.where(valid, path[c], 0.0), valid


def chain_decisions(survive: np.ndarray, valid: np.ndarray, h: float) -> np.ndarray:
    """(R, D) whether the node at depth j+1 is drafted under threshold h: the decision at depth j
    uses the predicted survival of the nodes at depth 1..j."""
    go_on = np.ones_like(valid)
    go_on[:, 1:] = (1.0 - survive[:, :-1]) <= h
    return go_on & valid


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", type=Path, required=True)
    ap.add_argument("--heldout", type=Path, required=True)
    ap.add_argument("--profile", type=Path, default=None, help="device profile JSON for the simulated costs")
    ap.add_argument("--layers", type=int, default=2, help="residual blocks in the head")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--reject-weight", type=float, default=6.0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="folder (default models/decision-models)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    costs = ChainCosts.load(args.profile)
    fit, held = load_traces(args.fit), load_traces(args.heldout)
    for name, d in (("fit", fit), ("heldout", held)):
        if "hidden" not in d:
            sys.exit(f"{name} traces have no hidden states; collect them with tools/collect_traces.py --hidden")
    keep = fit["hidden_valid"] > 0
    x = torch.from_numpy(fit["hidden"][keep].astype(np.float32))
    y = torch.from_numpy(fit["label_sampling"][keep].astype(np.float32))
    t0 = time.perf_counter()
    head = train(x, y, args.layers, args.epochs, args.reject_weight)
    train_s = time.perf_counter() - t0

    acc_fit, acc_held = predict(head, fit["hidden"]), predict(head, held["hidden"])
    survive, ok, valid = chain_survival(fit, acc_fit)
    scores = {float(h): simulate(drafted_from_decisions(chain_decisions(survive, valid, h), 1), ok, costs, MAX_DEPTH)
              for h in GRID}
    h_best = max(scores, key=lambda h: scores[h]["tokens_per_s"])
    survive, ok, valid = chain_survival(held, acc_held)
    held_sim = simulate(drafted_from_decisions(chain_decisions(survive, valid, h_best), 1), ok, costs, MAX_DEPTH)
    statics = static_table(ok, valid, costs, MAX_DEPTH)
    best_k = max(statics, key=lambda k: statics[k]["tokens_per_s"])
    hv = held["hidden_valid"] > 0
    soft_h = held["label_sampling"][hv]
    with torch.no_grad():
        held_loss = float(weighted_bce(torch.logit(torch.from_numpy(acc_held[hv]).clamp(1e-6, 1 - 1e-6)),
                                       torch.from_numpy(soft_h), args.reject_weight))
    drafter = fit["settings"].get("drafter")
    card = {
        "what": "SpecDec++ acceptance head (P(draft token accepted) from the draft's hidden state) for the "
                "specdecpp policy",
        "paper": "Huang et al. 2024, arXiv 2405.19715",
        "drafter": drafter, "hidden": int(x.shape[1]), "layers": args.layers,
        "loss": f"BCE on soft labels min(1, p/q), rejection term weighted {args.reject_weight}",
        "threshold": h_best, "threshold_rule": "max simulated tokens/s on the fitting split's chains",
        "metrics_heldout": {
            "weighted_bce": held_loss, "rows": int(hv.sum()),
            "auc_greedy_label": auc_or_none(held["label_greedy"][hv], acc_held[hv]),
            "auc_soft_label_above_half": auc_or_none(soft_h > 0.5, acc_held[hv]),
            "mean_pred": float(acc_held[hv].mean()), "mean_soft_label": float(soft_h.mean()),
            "simulated_specdecpp": held_sim, "simulated_best_static": {"k": best_k, **statics[best_k]},
            "simulated_static": statics},
        "simulated_fit_by_threshold": {str(h): v for h, v in scores.items()},
        "costs": costs.as_dict(), "train_s": round(train_s, 1), "epochs": args.epochs,
        "data": {"fit": {"rows": int(keep.sum()), "questions": int(len(np.unique(fit["question_id"]))),
                         "command": trace_command(fit["settings"], args.fit)},
                 "heldout": {"rows": int(hv.sum()), "questions": int(len(np.unique(held["question_id"]))),
                             "command": trace_command(held["settings"], args.heldout)}},
        "command": "python tools/train_specdecpp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = args.out or models_dir() / "decision-models"
    head.save(out, h_best, drafter, meta={"trained_on": card["data"]["fit"]["command"]})
    SpecDecHead.load(out / "specdecpp.json")                          # what is written must load
    (out / "specdecpp-card.json").write_text(json.dumps(portable(card), indent=1))
    print(f"SpecDec++: held-out AUC {card['metrics_heldout']['auc_greedy_label']} (greedy labels), h {h_best}; "
          f"simulated held-out tau {held_sim['tau']:.2f}, {held_sim['tokens_per_s']:.1f} tok/s vs best static "
          f"k={best_k} {statics[best_k]['tokens_per_s']:.1f} tok/s; {train_s:.0f} s training -> {out}")
    return 0
