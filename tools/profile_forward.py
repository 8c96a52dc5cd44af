"""Where a target forward's time goes, per block size: matmul, attention, elementwise, copies, Python.

    python tools/profile_forward.py --threads 1                  # the embedded target, bfloat16
    python tools/profile_forward.py --dtype float32 --sizes 1,9 --path packed --json out.json
    python tools/profile_forward.py --stand-in smollm2-135m      # random weights, same shapes
    python tools/profile_forward.py --weights q4                 # the GGUF's 4-bit codes on the q4 kernel
    python tools/profile_forward.py --weights q4q8 --dtype float32   # those codes on 8-bit activations
    python tools/profile_forward.py --path packed --separate-projections   # q / k / v as three products

Runs a 1-token step and verifies of 2-64 rows over a `--cache-len` cache under
torch.profiler and prints one line per block size (see `mcsd.costs.forward_profile`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path


def main(argv=None) -> int:
    from mcsd.config import WEIGHTS
    from mcsd.costs.timing import STAND_INS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="target source (default: the embedded preset)")
    ap.add_argument("--stand-in", choices=sorted(STAND_INS), help="a random-weight model of this architecture")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64", help="comma-separated block sizes")
    ap.add_argument("--cache-len", type=int, default=300, help="committed positions before the block")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--path", choices=("aten", "onednn", "packed"), default=None,
                    help="matmul path (default: torch's own choice; see mcsd.forward.kernels)")
    ap.add_argument("--attention", default="auto", help="auto, sdpa, gqa or eager (default auto: what the engine runs)")
    ap.add_argument("--weights", choices=WEIGHTS, default="dense",
                    help="q4: the target's Q4_1 GGUF codes on the q4 kernel; q4q8: on 8-bit activations "
                         "(float32; mcsd.forward.quant)")
    ap.add_argument("--separate-projections", action="store_true",
                    help="on prepacked weights, run q / k / v as three products, not one (mcsd.forward.fused): the 'before'")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--top", action="store_true", help="also list the operations with the most self time")
    ap.add_argument("--json", type=Path, help="also write the breakdown here")
    args = ap.parse_args(argv)
    try:
        sizes = tuple(int(n) for n in args.sizes.split(","))
    except ValueError:
        ap.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if args.separate_projections and (args.weights != "dense" or args.path != "packed"):
        ap.error("--separate-projections compares prepacked dense weights: use it with --path packed "
                 "and dense --weights")
    if min(sizes) < 1 or args.cache_len < 1 or args.repeats < 1:
        ap.error("--sizes, --cache-len and --repeats must be positive")

    import torch

    from mcsd.costs.forward_profile import breakdown, format_table, memory_floor, to_json
    from mcsd.costs.profile import machine_info
    from mcsd.costs.timing import stand_in
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stand_in:
        model = stand_in(args.stand_in, args.dtype)
    else:
        from mcsd.drafting.pair import load_model
        from mcsd.loading.presets import DEFAULT_PRESET
        model = load_model(args.target or DEFAULT_PRESET, args.dtype, "cpu", weights=args.weights)
    from mcsd.config import ConfigError
    from mcsd.forward.attention import set_backend
    try:
        set_backend(model, args.attention)
    except ConfigError as exc:
        ap.error(str(exc))
    results = breakdown(model, sizes, cache_len=args.cache_len, repeats=args.repeats, path=args.path,
                        join=not args.separate_projections)
    floor = memory_floor(model)
    on = {"q4": " on q4 weights", "q4q8": " on q4 weights, 8-bit activations"}.get(args.weights, "")
    print(f"{model.config._name_or_path} {args.dtype}{on}, "
          f"{torch.get_num_threads()} thread(s), "
          f"cache {args.cache_len}, matmul path {args.path or 'default'}"
          f"{', q / k / v separate' if args.separate_projections else ''}, attention "
          f"{model.config._attn_implementation}; ms per forward (share of wall)")
    print(format_table(results, floor))
    if args.top:
        for r in results:
            print(f"\n{r.rows} rows: " + "; ".join(f"{name} {ms:.2f} ms x{calls:g}" for name, ms, calls in r.top))
    if args.json:
        meta = {"model": model.config._name_or_path, "dtype": args.dtype, "weights": args.weights,
                "threads": torch.get_num_threads(),
                "path": args.path, "joined_projections": not args.separate_projections,
                "attention": model.config._attn_implementation, "host": machine_info("cpu"),
                "memory_floor": dataclasses.asdict(floor)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(to_json(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
