"""Turn a pytest-benchmark JSON from `benchmarks/` into a Markdown report and PNG plots.

`python tools/bench_report.py bench.json --out DIR` prints the report and writes it as `report.md` with
the plots; the commands that make the JSON are in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import itertools
import json
import operator
from datetime import datetime, timezone
from pathlib import Path


def load(path: Path) -> tuple[list[dict], dict]:
    data = json.loads(path.read_text())
    rows = [b["extra_info"] for b in data.get("benchmarks", []) if "method" in b.get("extra_info", {})]
    forward = [b["extra_info"] for b in data.get("benchmarks", [])
               if {"breakdown", "compare_ms"} & set(b.get("extra_info", {}))]
    if not rows and not forward:
        raise SystemExit(f"{path}: no mcsd speed benchmarks found (run pytest benchmarks/ --benchmark-json=...)")
    return rows, {"datetime": data.get("datetime"), **(rows or forward)[0].get("environment", {}), "forward": forward}


def forward_markdown(infos: list[dict]) -> list[str]:
    """Tables from `benchmarks/test_forward_profile.py`: ms per operation class and block size, and
    the forward paths' median ms per block size (interleaved in one process)."""
    lines = []
    for info in infos:
        if "breakdown" in info:
            classes = list(info["breakdown"][0]["ms"])
            lines += ["", f"Where a forward's time goes ({info.get('cache_len')}-token cache, attention "
                          f"{info.get('attention')}; ms of a profiled forward):", "",
                      "| rows | wall ms | " + " | ".join(classes) + " | ATen ops |",
                      "| ---: | ---: |" + " ---: |" * len(classes) + " ---: |"]
            for r in info["breakdown"]:
                lines.append(f"| {r['rows']} | {r['wall_ms']:.1f} | " + " | ".join(f"{r['ms'][c]:.1f}" for c in classes)
                             + f" | {r['ops']} |")
            floor, first = info.get("memory_floor"), info["breakdown"][0]
            if floor:
                lines += ["", f"Memory floor: {floor['weight_mb']:.1f} MB of weights a forward, read at "
                              f"{floor['read_gb_s']:.1f} GB/s here: {floor['ms']:.2f} ms; the {first['rows']}-row forward is "
                              f"{first['wall_ms'] / floor['ms']:.2f}x that."]
        if "compare_ms" in info:
            names = list(info["compare_ms"])
            sizes = list(info["compare_ms"][names[0]])
            lines += ["", "Forward paths, median ms per block size (interleaved in one process):", "",
                      "| rows | " + " | ".join(names) + " |", "| ---: |" + " ---: |" * len(names)]
            for n in sizes:
                lines.append(f"| {n} | " + " | ".join(f"{info['compare_ms'][m][n]:.1f}" for m in names) + " |")
    return lines


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _same(row: dict) -> str:
    """yes, no (on how many prompts), or - where no baseline ran to compare with."""
    mismatched = row.get("mismatched_prompts", [])
    return "yes" if row.get("equal_to_baseline") else f"no ({len(mismatched)} prompts)" if mismatched else "-"


def tree_size(spec: str | None) -> int:
    """Draft nodes of a k-config ("4,2,2" -> 4 + 8 + 16 = 28); 0 for none."""
    return sum(itertools.accumulate((int(k) for k in spec.split(",")), operator.mul)) if spec else 0


def header(rows: list[dict], env: dict) -> str:
    """One line of the run's settings: weights (dense in JSON older than them), dtype, decoding, order, llama.cpp."""
    temperature = env.get("temperature") or 0.0
    decoding = "greedy" if not temperature else f"sampled at T {temperature:g}, top-p {env.get('top_p', 1.0):g}"
    order = "interleaved prompt by prompt" if any(r.get("interleaved") for r in rows) else "one method after another"
    order += f", each prompt's quickest of {env['turns']} turns" if (env.get("turns") or 1) > 1 else ""
    line = f"## {env.get('weights') or 'dense'} weights, {env.get('dtype')}, {decoding}, {order}"
    if any(r.get("family") == "llama_cpp" for r in rows):
        line += f"; llama.cpp {env.get('llama_cpp', 'in the benchmark process (before it had its own)')}"
    return line


def markdown(rows: list[dict], env: dict) -> str:
    if not rows:                                  # only the forward profile ran
        return "\n".join(forward_markdown(env.get("forward", []))[1:]) + "\n"
    when = env.get("datetime") or datetime.now(timezone.utc).isoformat()
    lines = [header(rows, env), "",
             f"Machine: {env.get('processor')} ({env.get('cpu_count')} cores, {env.get('threads')} threads"
             f"{', ' + env['cuda'] if env.get('cuda') else ''}); {env.get('device')}; "
             f"torch {env.get('torch')}, transformers {env.get('transformers')}; "
             f"{env.get('prompts')} prompts x {env.get('max_new_tokens')} new tokens; {when[:10]}.", ""]
    notes = ("**A smoke run (`--bench-smoke`): it shows that the harness runs and is not a measurement.**"
             if env.get("smoke") else None, baseline_spread(rows))
    lines += [f"{note}\n" for note in notes if note]
    lines += ["| method | tree | tokens/s | speedup | tau | accept by depth | same output as baseline |",
              "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        depth = " ".join(f"{a:.2f}" for a in r.get("accept_by_depth", [])[:6]) or "-"
        lines.append(f"| {r['method']} | {r.get('tree') or '-'} | {_fmt(r['tokens_per_s'], '.1f')} | "
                     f"{_fmt(r.get('speedup'))} | {_fmt(r['tau'])} | {depth} | {_same(r)} |")
    groups = sorted({g for r in rows for g in r.get("by_category", {})})
    if groups:
        lines += ["", "Speedup (tau) by category group:", "",
                  "| method | " + " | ".join(groups) + " |", "| --- |" + " ---: |" * len(groups)]
        for r in rows:
            cells = [f"{_fmt(c.get('speedup'))} ({_fmt(c['tau'])})" if (c := r["by_category"].get(g)) else "-"
                     for g in groups]
            lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    if not env.get("smoke") and (best := _best(rows)):      # a smoke run's figures rank nothing
        lines += ["", best]
    lines += forward_markdown(env.get("forward", []))
    return "\n".join(lines) + "\n"


def baseline_spread(rows: list[dict]) -> str | None:
    """A warning where the ways of running plain decoding (the baseline family) differ more than 2x in tokens/s."""
    base = sorted((r["tokens_per_s"], r["method"]) for r in rows if r["family"] == "baseline" and r["tokens_per_s"])
    if len(base) > 1 and base[-1][0] > 2 * base[0][0]:
        return (f"**Warning: the baseline family spreads {base[-1][0] / base[0][0]:.1f}x** ({base[0][1]} "
                f"{base[0][0]:.1f} tokens/s, {base[-1][1]} {base[-1][0]:.1f}): a busy machine or a baseline that "
                f"misran; no speedup here holds.")
    return None


def _best(rows: list[dict]) -> str | None:
    def top(families):
        cands = [r for r in rows if r["family"] in families and r.get("speedup")]
        return max(cands, key=lambda r: r["speedup"]) if cands else None
    lines = []
    ours, hf = top(("chain", "tree", "policy", "context")), top(("hf_assisted",))   # every mcsd method
    if ours and hf:
        lines.append(f"Best mcsd method: {ours['method']} at {ours['speedup']:.2f}x over baseline; best Hugging "
                     f"Face assisted setting: {hf['method']} at {hf['speedup']:.2f}x; ratio "
                     f"{ours['speedup'] / hf['speedup']:.2f}.")
    ctx, lookup = next((r for r in rows if r["method"] == "context" and r.get("speedup")), None), \
        top(("hf_prompt_lookup",))
    if ctx and lookup:
        lines.append(f"Context drafting alone: {ctx['speedup']:.2f}x over baseline; best Hugging Face prompt "
                     f"lookup setting: {lookup['method']} at {lookup['speedup']:.2f}x; ratio "
                     f"{ctx['speedup'] / lookup['speedup']:.2f}.")
    return " ".join(lines) or None


def plots(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []

    def save(fig, name):
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    groups = sorted({g for r in rows for g in r.get("by_category", {})})
    shown = [r for r in rows if r.get("speedup") is not None]
    if groups and shown:
        fig, ax = plt.subplots(figsize=(max(8, len(shown) * 0.9), 4.5))
        width = 0.8 / len(groups)
        for i, g in enumerate(groups):
            ys = [(r["by_category"].get(g) or {}).get("speedup") or 0 for r in shown]
            ax.bar([x + i * width for x in range(len(shown))], ys, width, label=g)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shown))])
        ax.set_xticklabels([r["method"] for r in shown], rotation=40, ha="right")
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title("Speedup by category group")
        ax.legend(fontsize=8)
        save(fig, "speedup_by_category.png")
    trees = [r for r in rows if r["family"] in ("chain", "tree", "policy") and r.get("tree")]
    if trees:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for r in trees:
            x = tree_size(r["tree"])
            ax.scatter(x, r["tau"], color="C0" if r["family"] == "chain" else "C1" if r["family"] == "tree" else "C2")
            ax.annotate(r["method"], (x, r["tau"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("draft nodes in the largest tree")
        ax.set_ylabel("tau (tokens per target forward)")
        ax.set_title("Mean accepted tokens against tree size")
        save(fig, "tau_vs_tree_size.png")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="pytest-benchmark JSON from benchmarks/")
    ap.add_argument("--out", type=Path, default=Path("bench-report"), help="output folder")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    rows, env = load(args.json)
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, env)
    (args.out / "report.md").write_text(text)
    print(text)
    for p in [] if args.no_plots else plots(rows, args.out):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
