"""The acceptance model's `sampled` table: a logit shift per temperature, fitted on decoding itself.

The learned policy's acceptance model is fitted on greedy labels (a node is accepted where it is the
target's argmax). Sampling, a node is accepted where it is the target's seeded draw at its position,
and the model's features are read from the draft's distribution at the sampling temperature, which
sharpens or flattens them: at T 0.5 the model expects more than greedy and gets less, at T 1.3 the
reverse. This fits, for each temperature of a grid, the one shift `b` of the model's logit for which
the drafted rounds' expected accepted tokens (each node's path probability, the product of
sigmoid(logit + b) along its path) add up to the tokens those rounds accepted.

Every round drafts (`LearnedPolicy.every_round`), on the fit split's prompts (question_id % 5 !=
0), with the decoder's own drafter and policy; a second pass runs with the first pass's shifts in place,
so the trees are the ones the fitted policy grows, and is the one fitted. `--check` repeats the
measurement on the held-out split with the fitted table: expected against accepted per temperature.
The table is written into the acceptance model's file (`sampled`), and its card.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

GRID = (0.0, 0.3, 0.5, 0.7, 0.85, 1.0, 1.2, 1.5)


def round_record(tree, pred: list[float], shift: float, accepted: int) -> tuple[list, list, int] | None:
    """One drafted round as (parents, raw logits, accepted drafted tokens): each node's conditional
    probability (its path probability over its parent's) turned back into the logit before `shift`;
    `pred`: each node's path probability (`node_probabilities`)."""
    if tree.size < 2:
        return None
    parents = tree.parents.tolist()
    logits = [0.0]
    for i in range(1, tree.size):
        parent = pred[parents[i]]
        cond = min(max(pred[i] / parent if parent > 0 else 0.0, 1e-9), 1 - 1e-9)
        logits.append(math.log(cond / (1 - cond)) - shift)
    return parents, logits, accepted


def expected(rounds: list, shift: float) -> float:
    """The rounds' expected accepted tokens with the logits shifted by `shift`."""
    total = 0.0
    for parents, logits, _ in rounds:
        path = [1.0]
        for i in range(1, len(parents)):
            path.append(path[parents[i]] / (1.0 + math.exp(-(logits[i] + shift))))
            total += path[i]
    return total


def fit_shift(rounds: list, lo: float = -8.0, hi: float = 8.0) -> float:
    """The shift whose expected tokens equal the accepted ones (bisection: expected grows with it)."""
    if not rounds:
        return 0.0
    accepted = sum(r[2] for r in rounds)
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected(rounds, mid) < accepted:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 4)


def measure(dec, prompts, temperatures, top_p: float, max_new_tokens: int, seed: int) -> dict[float, list]:
    """Every round drafted, at each temperature: the rounds' records (`round_record`)."""
    policy = dec.policy
    out = {}
    for t in temperatures:
        rounds: list = []

        def on_round(tree, acc):
            rec = round_record(tree, policy.node_probabilities(), policy.shift, int(acc.path.numel()) - 1)
            if rec is not None:
                rounds.append(rec)

        for i, ids in enumerate(prompts):
            sampling = {} if t == 0 else {"temperature": t, "top_p": top_p, "seed": seed + i}
            with policy.every_round():
                dec.generate(ids, max_new_tokens=max_new_tokens, on_round=on_round, **sampling)
        out[t] = rounds
    return out


def main(argv=None) -> int:
    from ..decoding.choice import apply_choice, choose_dtype
    from ..decoding.decoder import TreeDecoder
    from ..drafting.policies.learned import LearnedPolicy
    from ..drafting.pair import load_model_pair
    from ..loading.data import chat_ids, load_prompts, stratified
    from ..loading.models import gguf_source
    from ..loading.presets import DEFAULT_PRESET

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="feature", choices=("feature", "model"),
                    help="the embedded pair's drafter whose acceptance model is fitted")
    ap.add_argument("--weights", default="auto", help="the target's weights, as mcsd-generate's --weights")
    ap.add_argument("--prompts", default=None, help="Spec-Bench style JSONL (default: the shipped one)")
    ap.add_argument("--per-group", type=int, default=2, help="prompts of each category group per split")
    ap.add_argument("--temperatures", default=",".join(str(t) for t in GRID))
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--check", action="store_true", help="also measure the fitted table on the held-out split")
    ap.add_argument("--dry-run", action="store_true", help="print the table; write nothing")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    temps = sorted({float(t) for t in args.temperatures.split(",")})
    if not temps or temps[0] < 0:
        sys.exit("--temperatures: a comma-separated list of temperatures >= 0")

    target, draft, tok = load_model_pair(None, None, dtype="float32", device="cpu", drafter=args.drafter,
                                         weights="dense")
    gguf = gguf_source(DEFAULT_PRESET)
    target, draft = apply_choice(target, draft, choose_dtype(target, draft, gguf=gguf, weights=args.weights), gguf)
    dec = TreeDecoder(target, draft, tokenizer=tok, threads=None)
    if not isinstance(dec.policy, LearnedPolicy) or dec.policy.model_source == "given":
        sys.exit("the decoder's policy reads no acceptance model file")
    path = Path(dec.policy.model_source)
    spec = json.loads(path.read_text())
    spec.pop("sampled", None)
    model = dec.policy.model

    def ids(split):
        return [torch.tensor(chat_ids(tok, p.text)) for p in stratified(load_prompts(args.prompts, split=split),
                                                                       args.per_group)]

    fit_prompts = ids("fit")
    model.sampled = None                                           # pass 1: the model as fitted on greedy
    first = {t: fit_shift(r) for t, r in measure(dec, fit_prompts, temps, args.top_p, args.max_new_tokens,
                                                 args.seed).items()}
    model.sampled = (tuple(temps), tuple(first[t] for t in temps))
    rounds = measure(dec, fit_prompts, temps, args.top_p, args.max_new_tokens, args.seed)   # pass 2
    shifts = {t: fit_shift(r) for t, r in rounds.items()}
    table = {"temperature": temps, "logit_shift": [shifts[t] for t in temps], "top_p": args.top_p,
             "rounds": [len(rounds[t]) for t in temps], "prompts": len(fit_prompts), "split": "fit"}
    print("temperature  shift  rounds  expected/round at 0  accepted/round")
    for t in temps:
        r = rounds[t]
        n = max(len(r), 1)
        print(f"{t:11.2f} {shifts[t]:6.3f} {len(r):7d} {expected(r, 0.0) / n:20.3f} {sum(x[2] for x in r) / n:15.3f}")
    card_extra = {}
    if args.check:
        model.sampled = (tuple(temps), tuple(shifts[t] for t in temps))
        held = measure(dec, ids("heldout"), temps, args.top_p, args.max_new_tokens, args.seed)
        print("held out: temperature  expected/round  accepted/round")
        card_extra["heldout"] = {}
        for t in temps:
            r = held[t]
            n = max(len(r), 1)
            # the records hold the logits before the shift in force: expected with it again
            e, a = expected(r, model.logit_shift(t)) / n, sum(x[2] for x in r) / n
            print(f"          {t:11.2f} {e:15.3f} {a:15.3f}")
            card_extra["heldout"][str(t)] = {"rounds": len(r), "expected": round(e, 4), "accepted": round(a, 4)}
    if args.dry_run:
        return 0
    spec["sampled"] = table
    path.write_text(json.dumps(spec))
    card = path.with_name("acceptance-card.json")
    if card.is_file():
        info = json.loads(card.read_text())
        info["sampled"] = {**table, **card_extra, "fitted_with": f"mcsd.train.sampled_acceptance, --weights "
                                                                f"{args.weights}, {args.max_new_tokens} tokens"}
        card.write_text(json.dumps(info, indent=1) + "\n")
    print(f"wrote the 'sampled' table into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
