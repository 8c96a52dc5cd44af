"""A target forward's latency per block size on each forward path: transformers', the engine's own,
the engine's own padded to buckets, and those buckets replayed as CUDA graphs (on CUDA).

    python tools/profile_graphs.py --device cuda --dtype bfloat16          # the embedded target
    python tools/profile_graphs.py --stand-in smollm2-135m --device cuda   # random weights, same shapes
    python tools/profile_graphs.py --device cpu --dtype float32 --sizes 1,9

Each path runs a block of each size over a `--cache-len` cache, `--repeats` times in rotation with
the others (interleaved, so a slow spell of the machine falls on every path alike); the table gives
the median milliseconds per forward, with the GPU synchronised after each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main(argv=None) -> int:
    from mcsd.costs.timing import STAND_INS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="target source (default: the embedded preset)")
    ap.add_argument("--stand-in", choices=sorted(STAND_INS), help="a random-weight model of this architecture")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64", help="comma-separated block sizes")
    ap.add_argument("--cache-len", type=int, default=300, help="committed positions before the block")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    try:
        sizes = tuple(int(n) for n in args.sizes.split(","))
    except ValueError:
        ap.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if min(sizes) < 1 or args.cache_len < 1 or args.repeats < 1:
        ap.error("--sizes, --cache-len and --repeats must be positive")

    import torch

    from mcsd.costs.profile import machine_info
    from mcsd.costs.timing import stand_in
    from mcsd.forward.attention import causal_allowed
    from mcsd.forward.graphs import bucket_of
    from mcsd.forward.lm import CachedLM
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.stand_in:
        model = stand_in(args.stand_in, args.dtype, device)
    else:
        from mcsd.drafting.pair import load_model
        from mcsd.loading.presets import DEFAULT_PRESET
        model = load_model(args.target or DEFAULT_PRESET, args.dtype, device)
    cuda = device.startswith("cuda")
    paths = {"transformers": CachedLM(model, lean=False), "own": CachedLM(model, lean=True, static_blocks=False),
             "own, buckets": CachedLM(model, lean=True, static_blocks=True, cuda_graphs=False)}
    if cuda:
        paths["own, graphs"] = CachedLM(model, lean=True, static_blocks=True, cuda_graphs=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (args.cache_len,), generator=gen).to(device)
    for lm in paths.values():
        lm.reset()
        lm.extend(prefix)

    def once(lm, n: int) -> float:
        tokens = torch.randint(0, vocab, (n,), generator=gen).to(device)
        positions = torch.arange(args.cache_len, args.cache_len + n, device=device)
        allowed = causal_allowed(n, device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lm.forward(tokens, positions, allowed)
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000
        lm.truncate(args.cache_len)
        return ms

    table = {}
    for n in sizes:
        for lm in paths.values():                      # first use (captures, warm-up) stays out of the timing
            once(lm, n)
        times = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, lm in paths.items():
                times[name].append(once(lm, n))
        table[n] = {name: statistics.median(ts) for name, ts in times.items()}
    info = machine_info(device)
    print(f"# {info.get('gpu') or info.get('cpu')}, torch {torch.__version__}, {args.dtype}, cache {args.cache_len}, "
          f"median of {args.repeats}")
    print("| rows | bucket | " + " | ".join(paths) + " |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in paths) + " |")
    for n, row in table.items():
        print(f"| {n} | {bucket_of(n) or n} | " + " | ".join(f"{row[name]:.2f}" for name in paths) + " |")
    graphed = paths.get("own, graphs")
    if graphed is not None and graphed.blocks is not None:
        print(f"# {graphed.blocks.captures} graphs captured in {graphed.blocks.capture_s:.2f}s")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "dtype": args.dtype, "cache_len": args.cache_len,
                                         "ms": {str(n): row for n, row in table.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
