"""Measure and cache this machine's cost profile for a model pair (verify ms per tree size, draft ms per width).

    python tools/profile_device.py                      # the embedded pair, bfloat16, cpu
    python tools/profile_device.py --drafter feature    # the preset's target-feature head
    python tools/profile_device.py --target T --draft D --dtype float16 --device cuda --force

The profile is cached under <mcsd cache>/profiles/ and read by tree policies.
"""

from __future__ import annotations

import argparse

from mcsd import load_model_pair
from mcsd.profile import DEFAULT_SIZES, load_or_measure, measure, profile_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--drafter", default="model", choices=("model", "feature"),
                    help="with the preset: its standalone draft or its target-feature head")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--force", action="store_true", help="measure again even if a cached profile exists")
    args = ap.parse_args(argv)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, _ = load_model_pair(args.target, args.draft, dtype=args.dtype, device=args.device,
                                       drafter=args.drafter)
    path = profile_path(target, draft)
    if args.force:
        prof = measure(target, draft, sizes=DEFAULT_SIZES, repeats=args.repeats)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(prof.to_json())
    else:
        prof = load_or_measure(target, draft, repeats=args.repeats)
    one = prof.verify_ms[min(prof.verify_ms)]
    print(f"profile: {path}")
    print("tree tokens  verify ms  x one token")
    for n, ms in prof.verify_ms.items():
        print(f"{n:11d}  {ms:9.2f}  {ms / one:11.2f}")
    print("draft width  draft ms   x target 1-token")
    for n, ms in prof.draft_ms.items():
        print(f"{n:11d}  {ms:9.2f}  {ms / one:11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
