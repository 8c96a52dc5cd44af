"""Fit the acceptance models tree policies use, compare them on held-out traces, ship the best.

    python tools/train_decision_models.py --fit ~/.cache/mcsd/traces/fit --heldout ~/.cache/mcsd/traces/heldout

Fits a logistic regression (standardised features) and a gradient-boosted
tree ensemble on the fitting traces, in two stages: stage one without the
`parent_pred` feature, whose predictions, multiplied along each path, then
fill `parent_pred` for stage two (the policy feeds its own predictions there
at run time). Reports AUC and Brier score on the held-out traces, draws a
calibration plot, and writes the cheapest model to call whose held-out Brier
score is within `--brier-tolerance` of the lowest (the policy calls it once per
drafted level, so a dearer model must predict measurably better) as
plain JSON parameters (`acceptance.json`, loaded without running code) with
`acceptance-card.json` and `acceptance-calibration.png` beside it: under
models/decision-models (the generic model) by default, or in a drafter's own
folder (`--out models/<drafter>`), where the learned policy prefers it for
that drafter.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from mcsd.drafting.policies.acceptance import FEATURE_NAMES, AcceptanceModel, export_sklearn
from mcsd.loading.cache import models_dir
from mcsd.train import portable
from mcsd.train.length_data import path_labels

PARENT = FEATURE_NAMES.index("parent_pred")


def load_traces(folder: Path) -> dict[str, np.ndarray]:
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest["features"] != list(FEATURE_NAMES):
        sys.exit(f"{folder}: traces have features {manifest['features']}, this mcsd uses {list(FEATURE_NAMES)}")
    parts, offset = [], 0
    for name in manifest["shards"]:
        with np.load(folder / name, allow_pickle=False) as z:
            part = {k: z[k] for k in z.files}
        part["parent_row"] = np.where(part["parent_row"] >= 0, part["parent_row"] + offset, -1)
        offset += len(part["label_greedy"])
        parts.append(part)
    if not parts:
        sys.exit(f"{folder}: no traces yet")
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    out["groups"] = np.array(manifest["groups"])
    out["settings"] = manifest.get("settings", {})
    return out


def fill_parent_pred(x: np.ndarray, parent_row: np.ndarray, cond: np.ndarray) -> np.ndarray:
    """Path probability of each node's parent from conditional predictions (rows are parents-first)."""
    path = path_labels(cond, parent_row)
    x = x.copy()
    x[:, PARENT] = np.where(parent_row >= 0, path[np.maximum(parent_row, 0)], 1.0)
    return x


def trace_command(settings: dict, folder: Path) -> str:
    """The collect_traces.py command line that wrote a trace folder, from its manifest settings."""
    shown = str(folder.resolve()).replace(str(Path.home()), "~", 1)
    flags = [f"--out {shown}"]
    for key, value in settings.items():
        if value is None or value is False or (key == "limit" and value == 0):
            continue
        flag = "--" + key.replace("_", "-")
        flags.append(flag if value is True else f"{flag} {shlex.quote(str(value))}")
    return "python tools/collect_traces.py " + " ".join(flags)


def models():
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    return {
        "logistic": lambda: make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)),
        "gbt": lambda: GradientBoostingClassifier(n_estimators=150, max_depth=3, learning_rate=0.1, subsample=0.8,
                                                  random_state=0),
    }


def fit_two_stage(make, fit: dict, label: str):
    x, y = fit["features"].astype(np.float64), fit[label]
    cols = [i for i in range(x.shape[1]) if i != PARENT]
    stage1 = make().fit(x[:, cols], y)
    cond = stage1.predict_proba(x[:, cols])[:, 1]
    x2 = fill_parent_pred(x, fit["parent_row"], cond)
    return stage1, make().fit(x2, y), cols


def evaluate(stage1, model, cols, data: dict, label: str):
    from sklearn.metrics import brier_score_loss, roc_auc_score
    x = data["features"].astype(np.float64)
    cond = stage1.predict_proba(x[:, cols])[:, 1]
    x2 = fill_parent_pred(x, data["parent_row"], cond)
    p = model.predict_proba(x2)[:, 1]
    y = data[label]
    return p, {"auc": float(roc_auc_score(y, p)), "brier": float(brier_score_loss(y, p)),
               "base_rate": float(y.mean()), "rows": int(len(y))}


def feature_importance(stage1, model, cols, data: dict, label: str) -> dict[str, float]:
    """Held-out AUC lost when one feature's column is shuffled (mean of 3 shuffles)."""
    from sklearn.inspection import permutation_importance
    x = data["features"].astype(np.float64)
    x2 = fill_parent_pred(x, data["parent_row"], stage1.predict_proba(x[:, cols])[:, 1])
    r = permutation_importance(model, x2, data[label], scoring="roc_auc", n_repeats=3, random_state=0)
    return {name: round(float(v), 4) for name, v in zip(FEATURE_NAMES, r.importances_mean)}


def call_ms(spec: dict, rows: int = 32, repeats: int = 200) -> float:
    """Median time of one policy-sized prediction call (rows candidates of one draft level)."""
    import statistics

    import torch
    model = AcceptanceModel(spec, "export")
    x = torch.rand(rows, len(FEATURE_NAMES))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model.predict_proba(x)
        times.append(time.perf_counter() - t)
    return round(1e3 * statistics.median(times), 4)


def calibration_plot(curves: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.calibration import calibration_curve
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="perfect")
    for name, (y, p) in curves.items():
        frac, mean = calibration_curve(y, p, n_bins=10, strategy="quantile")
        ax.plot(mean, frac, marker="o", label=name)
    ax.set_xlabel("predicted acceptance")
    ax.set_ylabel("observed acceptance")
    ax.set_title("Calibration on held-out traces")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def choose(results: dict[str, dict], tolerance: float) -> str:
    """The model to ship: the cheapest per call among those whose held-out Brier score is within
    `tolerance` (relative) of the lowest."""
    lowest = min(m["brier"] for m in results.values())
    near = [n for n, m in results.items() if m["brier"] <= lowest * (1 + tolerance)]
    return min(near, key=lambda n: (results[n]["call_ms"], results[n]["brier"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", type=Path, required=True, help="trace folder of the fitting split")
    ap.add_argument("--heldout", type=Path, required=True, help="trace folder of the held-out split")
    ap.add_argument("--label", default="label_greedy", choices=("label_greedy",),
                    help="greedy acceptance (the sampling label min(1, p/q) is recorded for later use)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: models/decision-models; a drafter's folder to ship the model with that drafter")
    ap.add_argument("--brier-tolerance", type=float, default=0.01,
                    help="ship the cheapest model whose held-out Brier score is within this fraction of the "
                         "lowest (default 0.01; 0 ships the lowest)")
    args = ap.parse_args(argv)
    if args.brier_tolerance < 0:
        sys.exit(f"--brier-tolerance must be >= 0, got {args.brier_tolerance}")
    import sklearn

    t0 = time.time()
    fit, held = load_traces(args.fit), load_traces(args.heldout)
    if np.intersect1d(fit["question_id"], held["question_id"]).size:
        sys.exit("fitting and held-out traces share questions; collect them on separate splits")
    out = args.out or models_dir() / "decision-models"
    out.mkdir(parents=True, exist_ok=True)
    results, curves, fitted = {}, {}, {}
    for name, make in models().items():
        stage1, model, cols = fit_two_stage(make, fit, args.label)
        p, metrics = evaluate(stage1, model, cols, held, args.label)
        metrics["call_ms"] = call_ms(export_sklearn(model))
        results[name], fitted[name] = metrics, (stage1, model, cols)
        curves[name] = (held[args.label], p)
        print(f"{name:9s} held-out AUC {metrics['auc']:.3f}  Brier {metrics['brier']:.4f}  "
              f"(base rate {metrics['base_rate']:.3f}, {metrics['rows']} nodes), {metrics['call_ms']:.3f} ms a call")
    calibration_plot(curves, out / "acceptance-calibration.png")
    best = choose(results, args.brier_tolerance)
    importance = feature_importance(*fitted[best], held, args.label)
    print("held-out AUC lost without each feature:", importance)
    spec = export_sklearn(fitted[best][1], meta={"label": args.label, "metrics": results[best]})
    AcceptanceModel(spec, "export")                                  # the file we write must load
    (out / "acceptance.json").write_text(json.dumps(spec))
    card = {
        "what": "P(draft node accepted | parent accepted), for the learned tree policy",
        "chosen": best, "brier_tolerance": args.brier_tolerance, "features": list(FEATURE_NAMES),
        "label": args.label,
        "permutation_importance_auc": importance,
        "sklearn": sklearn.__version__, "metrics_heldout": results,
        "data": {name: {"nodes": int(len(d["label_greedy"])), "questions": int(np.unique(d["question_id"]).size),
                        "traces": d["settings"], "command": trace_command(d["settings"], folder)}
                 for name, d, folder in (("fit", fit, args.fit), ("heldout", held, args.heldout))},
        "command": ("python tools/train_decision_models.py " + " ".join(
            shlex.quote(a) for a in (argv or sys.argv[1:]))),
        "seconds": round(time.time() - t0, 1),
    }
    (out / "acceptance-card.json").write_text(json.dumps(portable(card), indent=1))
    print(f"wrote {out / 'acceptance.json'} ({best}), {out / 'acceptance-card.json'}, "
          f"{out / 'acceptance-calibration.png'}")
    return 0
