"""Measure and cache this machine's cost profile for a model pair (verify ms per tree size, draft ms per width).

    python tools/profile_device.py                      # the embedded pair, bfloat16, cpu
    python tools/profile_device.py --drafter feature    # the preset's target-feature head
    python tools/profile_device.py --target T --draft D --dtype float16 --device cuda --force
    python tools/profile_device.py --stand-in llama-1b --device cuda --attention xformers --out prof.json

The profile is cached under <mcsd cache>/profiles/ and read by tree policies.
`--stand-in` times a randomly initialised model of a named architecture
instead of loading weights (latency depends on shapes, not on weight values),
for machines the weights cannot reach; with `smollm2-135m` the preset's own
drafters are timed against it. `--out` writes the profile (with the machine's
processor or GPU, driver and torch version in its metadata) to a file instead
of the cache.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mcsd.costs.timing import STAND_INS


def _load(args):
    from mcsd import load_model_pair
    from mcsd.costs.timing import stand_in
    from mcsd.drafting.pair import load_feature_drafter, load_model
    from mcsd.loading.models import preset_draft_dir
    from mcsd.loading.presets import PRESETS
    if args.stand_in is None:
        return load_model_pair(args.target, args.draft, dtype=args.dtype, device=args.device,
                               drafter=args.drafter)[:2]
    target = stand_in(args.stand_in, args.dtype, args.device)
    if args.stand_in not in PRESETS or args.drafter == "none":
        return target, None
    directory = str(preset_draft_dir(PRESETS[args.stand_in], args.drafter))
    if args.drafter == "feature":
        return target, load_feature_drafter(directory, target, args.dtype)
    return target, load_model(directory, args.dtype, args.device, role="draft")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--drafter", default="model", choices=("model", "feature", "none"),
                    help="with the preset (or its stand-in): its standalone draft, its target-feature head, "
                         "or no draft timing")
    ap.add_argument("--stand-in", choices=sorted(STAND_INS),
                    help="time a random-weight model of this architecture instead of loading a target")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention", default=None, help="sdpa, eager or xformers (default: the model's own)")
    ap.add_argument("--sizes", default=None, help="comma-separated tree sizes (default: 1,2,4,...,64)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--force", action="store_true", help="measure again even if a cached profile exists")
    ap.add_argument("--out", type=Path, help="write the profile here (JSON) instead of the cache")
    args = ap.parse_args(argv)
    import torch

    from mcsd.costs.store import load_or_measure, profile_path
    from mcsd.costs.timing import DEFAULT_SIZES, measure
    from mcsd.forward.attention import set_backend
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft = _load(args)
    if args.attention:
        set_backend(target, args.attention)
        if isinstance(draft, torch.nn.Module):
            set_backend(draft, args.attention)
    sizes = tuple(int(n) for n in args.sizes.split(",")) if args.sizes else DEFAULT_SIZES
    if args.out:
        path, prof = args.out, measure(target, draft, sizes=sizes, repeats=args.repeats)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(prof.to_json())
    else:
        path = profile_path(target, draft)
        prof = load_or_measure(target, draft, force=args.force or args.sizes is not None, sizes=sizes,
                               repeats=args.repeats)
    best = {role: prof.best_ms(role) for role in ("verify", "draft")}
    one = best["verify"][min(best["verify"])]
    print(f"profile: {path}")
    print(json.dumps(prof.meta.get("host", {})))
    for role, label, size in (("verify", "verify ms", "tree tokens"), ("draft", "draft ms ", "draft width")):
        if not best[role]:
            continue
        default, aten = prof.paths(role)
        ratio = "x one token" if role == "verify" else "x target 1-token"
        print(f"{size}  {label}  {ratio}" + ("   oneDNN ms    ATen ms" if aten else ""))
        for n, ms in best[role].items():
            both = f"  {default[n]:10.2f} {aten[n]:10.2f}" if n in aten else ""
            print(f"{n:11d}  {ms:9.2f}  {ms / one:{len(ratio)}.2f}{both}")
        table = prof.kernel_table(role)
        if table is not None:
            print(f"matmul path: {table.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
