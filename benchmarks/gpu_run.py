"""The prepared GPU run (`tools/gpu_check.py` is its front end): `pytest -m gpu`, the embedded pair's
benchmark, a 16-round sync profile, one JSON.

Run on a GPU machine with only the carried tree (and the GGUF joined by `tools/gpu_carry.py`), in one
call, within 8 minutes:

    python tools/gpu_check.py --out benchmarks/results/gpu-check.json

1. `pytest -m gpu -q` (its summary line and time);
2. the embedded pair in bfloat16 on held-out prompts, 128 tokens, one interleaved run (each prompt
   through every method in turn), greedy and at T 0.7 (seeded): Hugging Face `generate` with a
   static cache of one `max_cache_len` for every prompt, compiled and warmed up (its first call's
   time reported apart), HF greedy on its dynamic cache, the plain loop, context drafting alone, the
   CLI default (its decoder as `mcsd-generate` builds it: on CUDA the static tree with context
   drafting), the same with `--policy learned` (its per-level decisions eager), and the feature head's
   static tree alone on the fixed-shape round (`round="fixed"`); tokens/s, mean accepted tokens, and from the runs themselves
   which round each ran and why (`GenerationStats.round`), the CUDA graphs its decoder captured (the
   target's and the head's) and the attention it ran;
3. 16 rounds of the CLI default and of the fixed round under `torch.cuda.set_sync_debug_mode`,
   counting synchronisations a round;
4. the batched round (`BatchDecoder`; on CUDA in fixed shapes replayed as graphs, `SlotBlocks`): the
   same prompts decoded with 1, 4, 8 and 16 slots,
   plainly and with the CLI default's context drafting, aggregate tokens/s and how many answers equal
   their lone run's;
5. one JSON: GPU, driver, torch, transformers, every figure; meant to be committed under
   benchmarks/results/.

A stage that would pass the time budget is skipped and says so in the JSON. `--tiny` runs the same
stages on a random tiny Llama with a random feature head (no download, any device): the CPU smoke
test of this script (tests/test_gpu_tools.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def environment(device: str) -> dict:
    import torch
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
           "device": device, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            env["driver"] = f"unknown ({exc})"
    return env


def install_carried_wheels() -> list[str]:
    """Wheels carried in .whl/ (gguf, xformers) installed into /tmp/site, which joins sys.path."""
    wheels = sorted(str(p) for p in (ROOT / ".whl").glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "-q", "--target",
                        "/tmp/site", *wheels], check=False)
        sys.path.insert(0, "/tmp/site")
        os.environ["PYTHONPATH"] = "/tmp/site" + os.pathsep + os.environ.get("PYTHONPATH", "")
    return wheels


def run_pytest(timeout_s: float) -> dict:
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                               "--tb=short", "-rf", "tests"], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s)
        lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
        return {"summary": lines[-1] if lines else "", "rc": done.returncode,
                "failures": [ln for ln in lines if ln.startswith("FAILED")][:20],
                "tail": done.stdout[-6000:] if done.returncode else "",     # why they failed
                "seconds": round(time.perf_counter() - t0, 1)}
    except subprocess.TimeoutExpired:
        return {"summary": f"timed out after {timeout_s:.0f} s", "rc": None, "seconds": timeout_s}


# ------------------------------------------------------------------ the pair and its methods

def load(args):
    """(target, feature drafter, tokenizer or None, prompts as (T,) id tensors, the CLI default's decoder,
    the same with the learned policy)."""
    import torch

    from mcsd import TreeDecoder
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        from mcsd.drafting.feature_draft import FeatureDrafter, FeatureHead, FeatureHeadConfig
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
        target = LlamaForCausalLM(cfg).eval().to(args.device, getattr(torch, args.dtype))
        target.generation_config.eos_token_id = None
        head = FeatureHead(FeatureHeadConfig(target_hidden=32, hidden=16, heads=2, kv_heads=1, vocab_size=64)).eval()
        drafter = FeatureDrafter(head.to(args.device, getattr(torch, args.dtype)), target)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(2, 64, (8 + 4 * i,), generator=g).to(args.device) for i in range(args.prompts)]
        default = TreeDecoder(target, drafter, tree="4,2,2", policy="static", attention="sdpa", calibrate=False)
        learned = TreeDecoder(target, drafter, policy="learned", attention="sdpa", calibrate=False, round="fixed")
        return target, drafter, None, prompts, default, learned
    from mcsd.cli.args import build_parser, settle_policy
    from mcsd.cli.generate import build_decoder, load_models
    from mcsd.loading.data import chat_ids, load_prompts, stratified
    cli = build_parser().parse_args(["--device", args.device, "--dtype", args.dtype, "--prompt", "x"])
    settle_policy(cli, drafting=True)
    target, drafter, tokenizer = load_models(cli)
    default, _ = build_decoder(cli, target, drafter, tokenizer)
    cli.policy, cli.tree = "learned", None                  # the learned policy, as the default was before CUDA's
    settle_policy(cli, drafting=True)
    learned, _ = build_decoder(cli, target, getattr(default, "drafter", drafter), tokenizer)
    texts = [p.text for p in stratified(load_prompts(split="heldout"))][:args.prompts]
    prompts = [torch.tensor(chat_ids(tokenizer, t), device=args.device) for t in texts]
    drafter = getattr(default, "drafter", drafter)
    return target, drafter, tokenizer, prompts, default, learned


def methods(target, drafter, tokenizer, default, learned, prompts, max_new: int) -> tuple[dict, dict]:
    """(name -> run(ids, temperature, seed) -> (new tokens, stats or None, note); name -> its decoder)."""
    import torch
    from transformers import StaticCache

    from mcsd import TreeDecoder
    from mcsd.forward.kv_cache import cache_keyword
    plain = TreeDecoder(target, None, tokenizer=tokenizer, attention="sdpa", calibrate=False)
    context = TreeDecoder(target, "context", tokenizer=tokenizer, attention="sdpa", calibrate=False)
    fixed = TreeDecoder(target, drafter, tokenizer=tokenizer, tree="4,2,2", policy="static", attention="sdpa",
                        calibrate=False, round="fixed")
    length = -(-(max(p.numel() for p in prompts) + max_new) // 256) * 256      # one max_cache_len for all

    def hf(ids, temperature, seed, static=False):
        kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0,
                  attention_mask=torch.ones_like(ids)[None])
        if temperature > 0:
            torch.manual_seed(seed)
            kw.update(do_sample=True, temperature=temperature, top_k=0)
        else:
            kw.update(do_sample=False)
        if static:
            kw[cache_keyword(target)] = StaticCache(config=target.config, max_cache_len=length)
        with torch.no_grad():
            out = target.generate(ids[None], **kw)
        return out[0, ids.numel():].tolist(), None, ""

    def ours(decoder, baseline=False):
        def run(ids, temperature, seed):
            gen = decoder.generate_baseline if baseline else decoder.generate
            out = gen(ids, max_new_tokens=max_new, temperature=temperature, seed=seed, ignore_eos=True)
            return out.tokens, out.stats, ""
        return run

    decoders = {"plain_loop": plain, "context": context, "cli_default": default, "fixed_round": fixed,
                "learned": learned}
    return {"hf_static": lambda ids, t, s: hf(ids, t, s, static=True), "hf_greedy": hf,
            "plain_loop": ours(plain, baseline=True), "context": ours(context), "cli_default": ours(default),
            "fixed_round": ours(fixed), "learned": ours(learned)}, decoders


def graphs_of(decoder) -> dict:
    """What a decoder's runs built and captured: the target's blocks and, where the fixed round ran, the
    head's (buckets made, CUDA graphs captured and the seconds it took, why capture was given up)."""
    out = {}
    parts = {"target": decoder.target.blocks,
             "head": decoder.fixed_round.blocks if decoder.fixed_round is not None else None}
    for part, blocks in parts.items():
        if blocks is not None:
            out[part] = {"built": blocks.built, "captured": blocks.captures,
                         "capture_s": round(blocks.capture_s, 3), "failure": blocks.failure}
    return out


def attention_of(decoder) -> str:
    """The attention a decoder's target ran, in words."""
    from mcsd.forward.attention import describe
    if decoder.target.path == "lean":
        return "the engine's own forward: torch SDPA over the static cache"
    return describe(decoder.attention)


def bench(args, deadline: float) -> dict:
    import torch
    target, drafter, tokenizer, prompts, default, learned = load(args)
    runs, decoders = methods(target, drafter, tokenizer, default, learned, prompts, args.max_new_tokens)
    runs = {name: run for name, run in runs.items() if name not in args.skip}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    result = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
              "rounds": {}, "settings": {}}
    # warm-up, apart: the static cache's compile, every graph capture
    warm = {}
    for name, run in runs.items():
        sync()
        t0 = time.perf_counter()
        _, stats, _ = run(prompts[0], 0.0, 0)
        sync()
        warm[name] = round(time.perf_counter() - t0, 3)
        if stats is not None:                    # which round the run itself says it ran, and why
            result["rounds"][name] = f"{stats.round} ({stats.round_reason})"
    result["first_call_s"] = warm
    result["graphs_after_warm_up"] = {name: graphs_of(d) for name, d in decoders.items()}
    result["attention"] = {name: attention_of(d) for name, d in decoders.items()}
    for temperature in (0.0, 0.7):
        key = "greedy" if temperature == 0 else f"T{temperature}"
        if time.monotonic() > deadline:
            result["settings"][key] = "skipped: time budget"
            continue
        totals = {name: {"tokens": 0, "seconds": 0.0, "accepted": [], "rounds": 0} for name in runs}
        for i, ids in enumerate(prompts):                    # one interleaved run
            for name, run in runs.items():
                sync()
                t0 = time.perf_counter()
                tokens, stats, _ = run(ids, temperature, 1000 + i)
                sync()
                totals[name]["seconds"] += time.perf_counter() - t0
                totals[name]["tokens"] += len(tokens)
                if stats is not None:
                    totals[name]["accepted"] += stats.accepted_per_round
                    totals[name]["rounds"] += stats.rounds
        figures = {}
        for name, t in totals.items():
            if t["seconds"] == 0:
                continue
            figures[name] = {"tokens_per_s": round(t["tokens"] / t["seconds"], 2), "tokens": t["tokens"],
                             "seconds": round(t["seconds"], 3)}
            if t["accepted"]:
                figures[name]["tau"] = round(1 + sum(t["accepted"]) / len(t["accepted"]), 3)
        base = figures.get("hf_static", {}).get("tokens_per_s")
        for name, f in figures.items():
            if base:
                f["vs_hf_static"] = round(f["tokens_per_s"] / base, 3)
        result["settings"][key] = figures
    # and after the timed runs: more only for buckets the warm-up's prompt did not use
    result["graphs"] = {name: graphs_of(d) for name, d in decoders.items()}
    result["_decoders"] = decoders
    return result


def batch_prompts(args, default) -> list:
    """`--batch-prompts` prompts: held-out ones (the tiny pair's random ids)."""
    import torch
    if args.tiny:
        g = torch.Generator().manual_seed(2)
        return [torch.randint(2, 64, (6 + 3 * i,), generator=g).to(args.device) for i in range(args.batch_prompts)]
    from mcsd.loading.data import chat_ids, load_prompts, stratified
    texts = [p.text for p in stratified(load_prompts(split="heldout"))][:args.batch_prompts]
    return [torch.tensor(chat_ids(default.tokenizer, t), device=args.device) for t in texts]


def sync_profile(args, decoders: dict, prompt, rounds: int = 16) -> dict:
    """Synchronisations a round over `rounds` rounds of the bench's CLI default and fixed round (torch's
    sync debug mode; on a CPU nothing is counted here: tests/host_reads.py counts the host reads at the
    dispatcher, in tests/test_fixed_round.py)."""
    import torch

    out = {}
    for name in ("cli_default", "fixed_round"):
        decoder = decoders[name]
        for temperature in (0.0, 0.7):
            decoder.generate(prompt, max_new_tokens=rounds * 2, temperature=temperature, seed=0)   # captures
            stream = decoder.stream(prompt, max_new_tokens=rounds * 8, temperature=temperature, seed=0,
                                    ignore_eos=True)
            next(stream)
            per_round, times, captured = [], [], []

            def captures():                       # graphs captured so far (a round that captures is slow)
                return sum(g.get("captured", 0) for g in graphs_of(decoder).values())
            for _ in range(rounds):
                before = captures()
                cuda = args.device.startswith("cuda")
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("warn")
                t0 = time.perf_counter()
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        try:
                            next(stream)
                        except StopIteration:
                            break
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(0)
                        torch.cuda.synchronize()
                times.append(round((time.perf_counter() - t0) * 1000, 3))
                per_round.append(sum("synchroniz" in str(w.message) for w in caught))
                captured.append(captures() - before)
            out[f"{name}/{'greedy' if temperature == 0 else 'T0.7'}"] = {
                "syncs_per_round": per_round, "max_syncs": max(per_round, default=0), "round_ms": times,
                "captures_per_round": captured}
    return out


def batch_stage(args, decoders: dict, prompts, deadline: float, sizes=(1, 4, 8, 16)) -> dict:
    """Aggregate tokens/s of `BatchDecoder` at each slot count over the same prompts (greedy, every answer
    `max_new_tokens` long), over the bench's plain decoder and its CLI default (context drafting);
    answers equal to the default's lone run's."""
    import torch

    from mcsd.decoding.batch import BatchDecoder
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    default = decoders["cli_default"]
    opts = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    lone = [default.generate(p, **opts).tokens for p in prompts]
    out = {"prompts": len(prompts)}
    for name, decoder in (("plain", decoders["plain_loop"]), ("context", default)):
        for size in sizes:
            if time.monotonic() > deadline:
                out[f"{name}/{size}"] = "skipped: time budget"
                continue
            batch = BatchDecoder(decoder, max_batch=size)
            batch.generate(prompts[:size], **opts)                  # warm-up
            sync()
            t0, rounds = time.perf_counter(), batch.rounds
            got = batch.generate(prompts, **opts)
            sync()
            seconds = time.perf_counter() - t0
            tokens = sum(len(g.tokens) for g in got)
            out[f"{name}/{size}"] = {"forward": type(batch.forward).__name__,
                                     "captured": getattr(batch.forward, "captures", 0),
                                     "tokens_per_s": round(tokens / seconds, 2), "seconds": round(seconds, 3),
                                     "rounds": batch.rounds - rounds, "same_as_lone": sum(g.tokens == t for g, t in
                                                                                 zip(got, lone))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu-check.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole run's time (default 8 minutes)")
    ap.add_argument("--no-pytest", action="store_true")
    ap.add_argument("--batch-prompts", type=int, default=16, help="prompts for the batched stage (0: none)")
    ap.add_argument("--tiny", action="store_true", help="a random tiny pair (the CPU smoke test)")
    ap.add_argument("--skip", nargs="*", default=[], help="methods to leave out of the benchmark, e.g. hf_greedy")
    args = ap.parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s
    report = {"environment": environment(args.device), "wheels": install_carried_wheels(), "stages": {}}

    def write():
        report["seconds"] = round(time.monotonic() - start, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))

    if not args.no_pytest:
        report["stages"]["pytest_gpu"] = run_pytest(timeout_s=min(150.0, args.budget_s * 0.3))
        write()
    try:
        result = bench(args, deadline - 60)
        decoders = result.pop("_decoders")
        default = decoders["cli_default"]
        report["stages"]["bench"] = result
        write()
        if time.monotonic() < deadline - 20:
            import torch
            prompt = torch.tensor([3, 17, 42, 5, 9, 11], device=args.device) if args.tiny else None
            if prompt is None:
                from mcsd.loading.data import chat_ids
                prompt = torch.tensor(chat_ids(default.tokenizer, "Write a short poem about the sea."),
                                      device=args.device)
            report["stages"]["sync_profile"] = sync_profile(args, decoders, prompt)
        else:
            report["stages"]["sync_profile"] = "skipped: time budget"
        write()
        if args.batch_prompts and time.monotonic() < deadline - 20:
            report["stages"]["batch"] = batch_stage(args, decoders, batch_prompts(args, default), deadline - 10)
    except Exception as exc:                 # the JSON still says what ran and what failed
        import traceback
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-4000:]
    write()
    print(json.dumps({k: v for k, v in report.items() if k != "traceback"}, indent=1, default=str)[:6000])
    return 0 if "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
