"""What the lossy multi-root variant costs in fidelity, beside what it buys in speed.

For each held-out prompt: the exact greedy output (mcsd's default, identical
to plain greedy decoding) and the output with --lossy-target-roots W. Reports
tokens/s of both, token agreement with the exact output (share of positions
equal, and the length of the common prefix), and the target's mean
log-likelihood per token of each output (teacher-forced), whose drop measures
how far the variant strays from what the target itself would say.

    python tools/lossy_roots_fidelity.py --roots 2 3 --tree 2,2,1 --limit 12
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from mcsd import TreeDecoder, load_model_pair
from mcsd.loading.data import chat_ids, load_prompts, stratified


@torch.inference_mode()
def mean_loglik(target, prompt: torch.Tensor, tokens: list[int]) -> float:
    """Mean log p_target(token | prefix) over the generated tokens."""
    if not tokens:
        return float("nan")
    seq = torch.cat([prompt, torch.tensor(tokens)]).to(target.device)[None]
    logp = target(seq).logits[0, prompt.numel() - 1:-1].float().log_softmax(-1)
    return float(logp.gather(1, seq[0, prompt.numel():, None]).mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tree", default="2,2,1")
    ap.add_argument("--roots", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--limit", type=int, default=12, help="prompts (stratified over category groups)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    target, draft, tok = load_model_pair(args.target, args.draft, dtype=args.dtype)
    prompts = stratified(load_prompts(args.prompts, "heldout"), per_group=max(1, args.limit // 6))[:args.limit]
    exact = TreeDecoder(target, draft, tokenizer=tok, tree=args.tree, policy="static")
    rows = {"exact": []}
    for w in args.roots:
        rows[f"lossy_w{w}"] = []
    lossy = {w: TreeDecoder(target, draft, tokenizer=tok, tree=args.tree, lossy_target_roots=w) for w in args.roots}
    for p in prompts:
        ids = torch.tensor(chat_ids(tok, p.text))
        ref = exact.generate(ids, max_new_tokens=args.max_new_tokens)
        rows["exact"].append({"tps": ref.stats.tokens_per_s, "tau": ref.stats.mean_accepted, "agree": 1.0,
                              "prefix": len(ref.tokens), "loglik": mean_loglik(target, ids, ref.tokens)})
        for w, dec in lossy.items():
            out = dec.generate(ids, max_new_tokens=args.max_new_tokens)
            n = min(len(out.tokens), len(ref.tokens))
            same = sum(a == b for a, b in zip(out.tokens, ref.tokens))
            prefix = next((i for i, (a, b) in enumerate(zip(out.tokens, ref.tokens)) if a != b), n)
            rows[f"lossy_w{w}"].append({"tps": out.stats.tokens_per_s, "tau": out.stats.mean_accepted,
                                        "agree": same / max(len(ref.tokens), 1), "prefix": prefix,
                                        "loglik": mean_loglik(target, ids, out.tokens)})
    summary = {m: {k: statistics.median(r[k] for r in rs) if k in ("tps", "prefix") else
                   statistics.fmean(r[k] for r in rs) for k in rs[0]} for m, rs in rows.items()}
    if args.json:
        print(json.dumps({"prompts": len(prompts), "tree": args.tree, "summary": summary}, indent=1))
    else:
        print(f"{len(prompts)} held-out prompts, tree {args.tree}, {args.max_new_tokens} new tokens")
        print("method      tokens/s(median)  tau   agreement  common prefix(median)  target loglik/token")
        for m, s in summary.items():
            print(f"{m:10s}  {s['tps']:16.1f}  {s['tau']:4.2f}  {s['agree']:9.3f}  {s['prefix']:21.0f}  "
                  f"{s['loglik']:19.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
