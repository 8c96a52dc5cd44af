"""Measure a draft model against its target and write the figures on its card.

Two figures decide whether a draft is worth shipping:

- cost: the draft's 1-token forward over a ~200-token KV cache, as a
  fraction of the target's (both bfloat16, `--threads` CPU threads, median
  of `--runs` interleaved runs, so load from other processes hits both alike).
  Speculative decoding pays this once per drafted token, so it bounds the
  speedup.
- agreement: teacher-forced on the target's own greedy responses to the
  held-out Spec-Bench prompts (question_id % 5 == 0), how often the draft's
  argmax is the target's greedy token (top-1) and how often that token is
  in the draft's top 4 (top-4; what a tree of width 4 can catch). The
  responses are generated once with the bfloat16 target through
  tools/target_data.py and cached as the run `heldout-greedy-bf16`.

Example:
    python tools/measure_draft.py --draft models/smollm2-135m-draft
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from mcsd.forward import kv_cache
from mcsd.train import data as td
from mcsd.train import distill as dd
from mcsd.train import engine, portable

HELDOUT_RUN = "heldout-greedy-bf16"


def interleaved_cost(steps: dict, runs: int, warmup: int, cache_len: int) -> dict:
    """Median time of the "target" and "draft" steps, timed alternately.

    steps: {"target" | "draft": (step, undo)}; step() is the timed forward,
    undo() takes its token out of the cache again, so every run sees the same
    cache length. Returns {"target_ms", "draft_ms", "ratio", "runs", "cache_len"}.
    """
    times = {"target": [], "draft": []}
    for r in range(warmup + runs):
        for role, (step, undo) in steps.items():
            t0 = time.perf_counter()
            step()
            elapsed = time.perf_counter() - t0
            undo()
            if r >= warmup:
                times[role].append(elapsed)
    target_ms, draft_ms = (statistics.median(times[role]) * 1000 for role in ("target", "draft"))
    # to the microsecond: the ratio then agrees with the rounded times even for sub-millisecond steps
    return {"target_ms": round(target_ms, 3), "draft_ms": round(draft_ms, 3),
            "ratio": round(draft_ms / target_ms, 4), "runs": runs, "cache_len": cache_len}


@torch.inference_mode()
def measure_cost(target, draft, context: list[int], runs: int = 30, warmup: int = 3) -> dict:
    """1-token forward of target and draft over a len(context) KV cache (see `interleaved_cost`)."""
    from transformers import DynamicCache

    ids = torch.tensor([context])  # (1, T)
    token = ids[:, -1:]  # (1, 1)
    steps = {}
    for role, model in (("target", target), ("draft", draft)):
        cache, kw = DynamicCache(), kv_cache.cache_keyword(model)
        model(input_ids=ids, use_cache=True, **{kw: cache})
        steps[role] = (lambda m=model, c=cache, k=kw: m(input_ids=token, use_cache=True, **{k: c}),
                       lambda c=cache: c.crop(-1))
    return interleaved_cost(steps, runs, warmup, len(context))


@torch.inference_mode()
def measure_feature_cost(target, drafter, context: list[int], runs: int = 30, warmup: int = 3) -> dict:
    """Like `measure_cost`, for a target-feature drafter: one draft step (the
    head's 1-token forward over a len(context) cache, plus its LM-head scores)
    against the target's 1-token forward."""
    from mcsd.forward.lm import CachedLM

    ids = torch.tensor(context)
    lm = CachedLM(target)
    lm.reset()
    _, hidden = lm.extend(ids[:-1], hidden=tuple(drafter.feature_layers))   # the features the head reads
    drafter.reset()
    drafter.observe_target(hidden)
    drafter.begin_round(ids)                               # the head's cache now holds the context

    def draft_step():                                      # drop the last entry, re-read it: the root's step
        kv_cache.truncate(drafter.cache, len(context) - 2)
        drafter.begin_round(ids)

    return interleaved_cost({
        "target": (lambda: lm.extend(ids[-1:]), lambda: kv_cache.truncate(lm.cache, len(context) - 1)),
        "draft": (draft_step, lambda: None),
    }, runs, warmup, len(context))


def timing_context(examples: list[dict], cache_len: int) -> list[int]:
    """A real ~cache_len-token context: the held-out prompt + response closest to that length."""
    best = max(examples, key=lambda e: -abs(len(e["prompt"]) + len(e["response"]) - cache_len))
    return torch.cat([best["prompt"], best["response"]]).tolist()[:cache_len]


def cost_figure(cost: dict, threads: int, what: str) -> dict:
    """An `interleaved_cost` result as the card records it."""
    return {**cost, "dtype": "bfloat16", "threads": threads, "device": "cpu", "what": what}


def write_figures(model_dir: Path, args, indent: int, **figures):
    """Merge `figures` into model_dir/card.json (figures measured elsewhere, such as
    the engine's from the benchmarks, are kept) and record the command that measured them."""
    card_path = model_dir / "card.json"
    card = json.loads(card_path.read_text()) if card_path.exists() else {}
    card.setdefault("figures", {}).update(figures)
    card.setdefault("reproduce", {})["measure"] = "python tools/measure_draft.py " + " ".join(
        sys.argv[1:] if args.argv is None else args.argv)
    card_path.write_text(json.dumps(portable(card), indent=indent) + "\n")
    print(f"updated {card_path}")


def feature_head_main(args, data_dir: Path) -> None:
    """--feature-head: the cost figure of a target-feature head, written on its card."""
    from mcsd.drafting.pair import load_feature_drafter

    target, _ = td.load_target(args.target, device="cpu", dtype=torch.bfloat16)
    drafter = load_feature_drafter(args.feature_head, target, "bfloat16")
    context = timing_context(td.load_examples(data_dir, [HELDOUT_RUN]), args.cache_len)
    cost = measure_feature_cost(target, drafter, context, args.runs)
    print(f"cost: feature head step {cost['draft_ms']} ms / target {cost['target_ms']} ms = {cost['ratio']:.3f}")
    if not args.no_card:
        write_figures(Path(args.feature_head), args, indent=1, cost_ratio=cost["ratio"], cost=cost_figure(
            cost, args.threads, "one draft step (1 token, cache of cache_len target features) against "
                                "the target's 1-token forward, median of interleaved runs"))


def depth_report_main(args, data_dir: Path) -> None:
    """--depth-report: acceptance by depth, teacher-forced and decoding, on the head's card."""
    from mcsd.drafting.pair import load_feature_drafter
    from mcsd.train import depth_report

    target, _ = td.load_target(args.target, device="cpu", dtype=getattr(torch, args.dtype))
    drafter = load_feature_drafter(args.depth_report, target, args.dtype)
    examples = td.load_examples(data_dir, [args.data_run], with_hidden=True)
    if args.per_group is not None:
        examples = depth_report.first_per_group(examples, args.per_group)
    result = depth_report.report(target, drafter, target.get_input_embeddings(), examples,
                                 max_new_tokens=args.max_new_tokens)
    result.update(run=args.data_run, dtype=args.dtype, threads=args.threads, prompts=len(examples))
    print(json.dumps(result, indent=1))
    if not args.no_card:
        write_figures(Path(args.depth_report), args, indent=1, depth_report=result)


def chain_acceptance_main(args) -> None:
    """--chain-acceptance: a feature head's acceptance along a static chain in decoding, greedy and
    sampled, on held-out Spec-Bench prompts, with the pair as the command line loads it."""
    from mcsd.drafting.pair import load_model_pair
    from mcsd.loading.data import chat_ids, load_prompts, stratified
    from mcsd.train import depth_report

    target, drafter, tokenizer = load_model_pair(args.target, args.chain_acceptance, dtype=args.dtype,
                                                 weights=args.weights)
    prompts = stratified(load_prompts(split="heldout"), args.per_group or 1)
    ids = [chat_ids(tokenizer, p.text) for p in prompts]
    settings = [(float(t), 0.95 if 0 < float(t) < 1 else 1.0) for t in args.temperatures.split(",")]
    rows = depth_report.chain_acceptance(target, drafter, ids, settings, seeds=tuple(range(args.seeds)),
                                         max_new_tokens=args.max_new_tokens)
    result = {"rows": rows, "prompts": len(prompts), "dtype": args.dtype, "weights": args.weights,
              "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "what": "static chain 1,1,1, shared-noise verify (a drafted token is accepted exactly when it is "
                      "the target's draw), held-out Spec-Bench prompts (question_id % 5 == 0), chat template"}
    for row in rows:
        print(f"T {row['temperature']:.1f} top-p {row['top_p']:.2f}: acceptance by depth {row['acceptance']}, "
              f"tau {row['tau']} ({row['generations']} generations)")
    if not args.no_card:
        write_figures(Path(args.chain_acceptance), args, indent=1, chain_acceptance=result)


def per_category(draft, examples: list[dict], pad_id: int, max_len: int) -> dict:
    """Top-1 / top-4 agreement by Spec-Bench category."""
    out = {}
    for category in sorted({e["category"] for e in examples}):
        seqs = [dd.make_sequence(e, max_len) for e in examples if e["category"] == category]
        out[category] = {k: round(v, 4) if isinstance(v, float) else v
                         for k, v in dd.agreement(draft, seqs, pad_id).items()}
    return out


def main(argv=None):
    """The draft's figures (see the module docstring); a run missing from the data dir ends it with
    one line."""
    try:
        return _measure(argv)
    except td.DataError as exc:
        sys.exit(str(exc))


def _measure(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=str(dd.DEFAULT_OUT), help="draft model directory (has card.json)")
    parser.add_argument("--target", default=td.DEFAULT_TARGET)
    parser.add_argument("--data-dir", default=None, help="default: $MCSD_CACHE/data/<target-name>")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=30, help="interleaved timing runs (median)")
    parser.add_argument("--cache-len", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=4096, help="held-out prompts are left-truncated to fit")
    parser.add_argument("--no-card", action="store_true", help="print only, leave card.json alone")
    parser.add_argument("--feature-head", default=None,
                        help="measure the cost of this target-feature head instead (its agreement figures "
                             "come from tools/train_feature_drafter.py)")
    parser.add_argument("--depth-report", default=None, metavar="HEAD",
                        help="this feature head's acceptance by depth, teacher-forced and decoding, per category "
                             "group, on --data-run (mcsd.train.depth_report); written on its card")
    parser.add_argument("--data-run", default="heldout-greedy",
                        help="with --depth-report: held-out greedy responses with the layers the head reads "
                             "(target_data.py generate, then teacher --store-layers)")
    parser.add_argument("--dtype", default="float32", help="with --depth-report: the target's dtype")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="with --depth-report: decoding length")
    parser.add_argument("--chain-acceptance", default=None, metavar="HEAD",
                        help="this drafter's acceptance along a static chain 1,1,1 in decoding, greedy and sampled "
                             "(--temperatures), on held-out Spec-Bench prompts; written on its card")
    parser.add_argument("--temperatures", default="0,0.7,1.0",
                        help="with --chain-acceptance: sampling temperatures (top-p 0.95 below 1.0)")
    parser.add_argument("--seeds", type=int, default=2, help="with --chain-acceptance: seeds per sampled prompt")
    parser.add_argument("--weights", default="q4", help="with --chain-acceptance: the target's weights")
    parser.add_argument("--per-group", type=int, default=None,
                        help="with --depth-report: the first N prompts of each category group (default: all)")
    args = parser.parse_args(argv)
    args.argv = argv
    torch.set_num_threads(args.threads)
    data_dir = Path(args.data_dir or td.default_data_dir(args.target))
    if args.feature_head:
        return feature_head_main(args, data_dir)
    if args.depth_report:
        return depth_report_main(args, data_dir)
    if args.chain_acceptance:
        return chain_acceptance_main(args)

    # 1. the target's own greedy responses to held-out prompts (cached, resumable)
    engine.main(["--target", args.target, "--data-dir", str(data_dir), "--threads", str(args.threads),
             "--dtype", "bfloat16", "generate", "--run", HELDOUT_RUN, "--split", "heldout"])

    from transformers import AutoModelForCausalLM

    target, tokenizer = td.load_target(args.target, device="cpu", dtype=torch.bfloat16)
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.bfloat16).eval()

    # 2. agreement, with the draft as shipped (bfloat16)
    examples = td.load_examples(data_dir, [HELDOUT_RUN])
    seqs = [dd.make_sequence(e, args.max_len) for e in examples]
    overall = dd.agreement(draft, seqs, tokenizer.pad_token_id)
    by_category = per_category(draft, examples, tokenizer.pad_token_id, args.max_len)
    print(f"held-out agreement: top1 {overall['top1']:.4f}  top4 {overall['top4']:.4f}  ({overall['n']} positions)")
    for category, r in by_category.items():
        print(f"  {category:15s} top1 {r['top1']:.3f}  top4 {r['top4']:.3f}  n {r['n']}")

    # 3. cost, on a real ~cache_len-token context (a held-out prompt + its response)
    cost = measure_cost(target, draft, timing_context(examples, args.cache_len), args.runs)
    print(f"cost: draft {cost['draft_ms']} ms / target {cost['target_ms']} ms = {cost['ratio']:.3f}")

    if not args.no_card:
        write_figures(
            Path(args.draft), args, indent=2, cost_ratio=cost["ratio"],
            cost=cost_figure(cost, args.threads,
                             "1-token forward with a KV cache of cache_len tokens, median of interleaved runs"),
            heldout_top1=round(overall["top1"], 4), heldout_top4=round(overall["top4"], 4),
            heldout={"positions": overall["n"], "sequences": len(examples), "run": HELDOUT_RUN,
                     "what": "teacher-forced on the bfloat16 target's greedy responses to Spec-Bench "
                             "question_id % 5 == 0 (first turn, chat template, <= 256 new tokens)",
                     "by_category": by_category})
