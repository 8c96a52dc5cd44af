"""Side-by-side speed: plain decoding, Hugging Face assisted generation, mcsd chains, trees and policies.

Every method runs on the same prompts in the same session. Recorded per method
in `benchmark.extra_info`: tokens/s, speedup over `baseline` (the ratio of tokens/s,
measured in this run), tau (tokens per target forward), acceptance by depth, the draft / verify /
other time split, whether the output equals the baseline's token for token,
and the same figures per category group. Nothing is asserted about speed.

By default one method runs on every prompt, then the next. With
`--bench-interleave` the selected methods run prompt by prompt in rotation,
every other prompt backwards (one interleaved run, as comparisons on a noisy machine want); the first test
then carries the whole run in pytest-benchmark's own timing and the others
none, so read the figures from `extra_info` (tools/bench_report.py does). With `--bench-turns N`
each prompt runs N turns of that rotation and a method's time on it is its quickest turn: a
busy spell of the machine only ever adds time (on a 2-core VM, rounds forced to be the plain
loop's own steps read 0.90-1.04x the plain loop over 12-24 prompts with one turn); the tokens/s of
every turn together are recorded beside it (`tokens_per_s_every_turn`).
"""

from __future__ import annotations

import pytest
from methods import all_methods

METHODS = all_methods()


def _summary(runs, base=None):
    """Totals of `runs`; with `base`, the baseline's (tokens, seconds) on the same prompts, the speedup:
    the ratio of tokens/s. (Methods can write different amounts of text, on q4 weights or sampled, so
    a ratio of times would compare different work.)"""
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    forwards = sum(r.target_forwards for r in runs)
    out = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
           "tau": tokens / forwards if forwards else 0.0}
    if base and base[0] and base[1]:
        out["speedup"] = out["tokens_per_s"] / (base[0] / base[1])
    return out


def _base(bench, questions):
    """The baseline's (tokens, seconds) on these prompts, or None where it did not run on all of them."""
    if not set(bench.baseline_time) >= set(questions):
        return None
    return sum(len(bench.baseline[q]) for q in questions), sum(bench.baseline_time[q] for q in questions)


def skip_reason(bench, method) -> str | None:
    """Why `method` cannot run in this session, or None."""
    if method.family in ("hf_assisted", "pearl") and bench.assistant is None:
        return f"{method.name} needs a standalone draft model"
    if method.family == "llama_cpp":
        from methods import llama_cpp_unavailable
        return llama_cpp_unavailable(bench)
    if method.name == "hf_compiled" and bench.smoke:
        return "compiling takes about a minute per shape on a CPU; not in the smoke run"
    if method.policy is not None:
        from mcsd.drafting.policies import make_policy, resolve_policy
        from mcsd.errors import ModelLoadError
        try:
            make_policy(resolve_policy(method.policy), method.tree)
        except ModelLoadError as exc:            # e.g. a learned policy whose model is not shipped yet
            return str(exc)
    return None


def run_order(methods: list, i: int) -> list:
    """The order of `methods` on the i-th turn of an interleaved run (a prompt's, or one of a prompt's
    turns): rotated by one place every other turn, and run backwards on every other turn, so that over
    twice as many turns as methods each takes every place in each direction and follows more than one
    other (the same plain loop through two decoders in one process read 0.991x / 0.998x each other in
    a fixed rotation at T 1.0, 1.003x / 1.002x with the order run backwards on every other prompt:
    docs/results.md, 2026-12-06 (night)). Two methods take turns at going first."""
    shift = (i // 2) % max(len(methods), 1)
    turn = methods[shift:] + methods[:shift]
    return turn if i % 2 == 0 else turn[::-1]


def interleaved_runs(bench, selected) -> dict[str, dict]:
    """Every runnable selected method on every prompt, prompt by prompt, in `run_order`, so a slow
    spell of the machine is shared out rather than landing on whichever methods happened to run then;
    `bench.turns` turns of the rotation per prompt, each method's quickest turn kept (its every turn's
    time in `bench.every_turn`, a prompt whose turns wrote different text in `bench.turns_differ`).
    Computed once per session."""
    if bench.interleaved is None:
        methods = [m for m in METHODS if m.name in selected and skip_reason(bench, m) is None]
        results: dict[str, dict] = {m.name: {} for m in methods}
        bench.every_turn = {m.name: {} for m in methods}
        bench.turns_differ = {m.name: [] for m in methods}
        for i, (prompt, ids) in enumerate(bench.prompts):
            q = prompt.question_id
            for turn in range(bench.turns):
                for m in run_order(methods, i * bench.turns + turn):
                    run = m.run(bench, ids)
                    bench.every_turn[m.name].setdefault(q, []).append(run.seconds)
                    kept = results[m.name].get(q)
                    if kept is not None and kept.tokens != run.tokens and q not in bench.turns_differ[m.name]:
                        bench.turns_differ[m.name].append(q)
                    if kept is None or run.seconds < kept.seconds:
                        results[m.name][q] = run
        bench.interleaved = results
    return bench.interleaved


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_method(benchmark, bench, method, request):
    reason = skip_reason(bench, method)
    if reason is not None:
        pytest.skip(reason)
    runs = {}

    def run_all():
        if bench.interleave:                    # already run, in rotation with the other methods
            runs.update(interleaved_runs(bench, request.config.selected_methods)[method.name])
            return
        for prompt, ids in bench.prompts:
            runs[prompt.question_id] = method.run(bench, ids)

    benchmark.pedantic(run_all, rounds=1, iterations=1)

    if method.name == "baseline":
        bench.baseline = {q: r.tokens for q, r in runs.items()}
        bench.baseline_time = {q: r.seconds for q, r in runs.items()}
    info = _summary(list(runs.values()), _base(bench, list(runs)))

    offered, accepted = [], []
    for r in runs.values():
        for d, (o, a) in enumerate(zip(r.offered_by_depth, r.accepted_by_depth)):
            if d >= len(offered):
                offered.append(0)
                accepted.append(0)
            offered[d] += o
            accepted[d] += a
    mismatched = [q for q, r in runs.items() if bench.baseline and r.tokens != bench.baseline.get(q)]
    by_group: dict[str, list] = {}
    for prompt, _ in bench.prompts:
        by_group.setdefault(prompt.group, []).append(prompt.question_id)
    every_turn = bench.every_turn.get(method.name, {})
    if bench.interleave and every_turn:
        every_s = sum(sum(t) for t in every_turn.values())
        info["tokens_per_s_every_turn"] = bench.turns * info["tokens"] / every_s if every_s else 0.0
        info["turns_differ"] = bench.turns_differ.get(method.name, [])
    info.update({
        "method": method.name, "family": method.family, "tree": method.tree, "interleaved": bench.interleave,
        "turns": bench.turns if bench.interleave else 1,
        "accept_by_depth": [a / o if o else 0.0 for a, o in zip(accepted, offered)],
        "context_nodes": sum(r.context_nodes for r in runs.values()),
        "context_accepted": sum(r.context_accepted for r in runs.values()),
        "draft_s": sum(r.draft_s for r in runs.values()),
        "verify_s": sum(r.verify_s for r in runs.values()),
        "policy_s": sum(r.policy_s for r in runs.values()),
        "equal_to_baseline": bool(bench.baseline) and not mismatched,
        "mismatched_prompts": mismatched,
        "by_category": {g: _summary([runs[q] for q in qs], _base(bench, qs)) for g, qs in by_group.items()},
        "environment": bench.environment,
    })
    info["other_s"] = max(info["seconds"] - info["draft_s"] - info["verify_s"], 0.0) \
        if method.family not in ("baseline", "hf_assisted", "llama_cpp") or method.name == "baseline_mcsd" else None
    benchmark.extra_info.update(info)
