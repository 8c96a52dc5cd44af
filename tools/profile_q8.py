"""The q4 target's forward and products by rows, on float32 activations ("q4") and on 8-bit ones
("q4q8"), each of the latter's instruction sets this CPU has: what decides whether the integer
products pay here. Run it on a quiet machine (nothing else on the cores):

    python tools/profile_q8.py                       # the embedded target, 1 / 4 / 9 / 16 rows
    python tools/profile_q8.py --threads 2 --rows 1,2,4,9,16 --cache-len 300 --json q8.json

First the products alone (each weight shape of the target's layers and its LM head, median of
`--repeats` calls; the same bits on every instruction set, so only the time differs), then whole
forwards over a `--cache-len` cache (`mcsd.costs.forward_profile.breakdown`, the engine's forward),
each with its cost relative to 1 row. Which path the command line runs is not decided here: the
calibrated costs weigh "q4/float32" against "q4q8/float32" (`mcsd.decoding.choice`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _median_ms(fn, repeats: int) -> float:
    fn()                                                    # warm-up: caches, the library's threads
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def products(model, rows: tuple[int, ...], repeats: int) -> list[dict]:
    """Per weight shape of `model` (attached on float32 activations), ms of one product by rows, on
    float32 activations and on 8-bit ones with each instruction set."""
    import torch

    from mcsd.forward import native, quant
    out, seen = [], set()
    for layer in model.modules():
        w = layer.__dict__.get(quant._ATTR)
        q4 = isinstance(w, quant.Q4Linear)
        if w is None or (q4, w.out_features, w.in_features) in seen:
            continue                                            # one entry a weight shape
        seen.add((q4, w.out_features, w.in_features))
        n = w.out_features
        if q4:                                                  # the same codes in the 8-bit product's layout
            blocks = w.codes.view(n, -1, quant.GROUP // 2)
            w8 = quant.interleave_q4(torch.cat([blocks & 15, blocks >> 4], -1).view(n, -1), w.d, w.m)
            float_mm, int8_mm = native.q4_mm, native.q4q8_mm
            on_float = (w.codes, w.d, w.m)
        else:
            w8 = quant.interleave_q8(w.codes, w.d)
            float_mm, int8_mm = native.q8_mm, native.q8q8_mm
            on_float = (w.codes, w.d)
        entry = {"kind": "Q4_1" if q4 else "Q8_0", "n": w.out_features, "k": w.in_features, "ms": {}}
        for rows_n in rows:
            x = torch.randn(rows_n, w.in_features)
            entry["ms"].setdefault("float32", {})[rows_n] = _median_ms(lambda: float_mm(x, *on_float), repeats)
            for isa in native.int8_isas_here():
                native.int8_isa(isa)
                entry["ms"].setdefault(f"int8 {isa}", {})[rows_n] = _median_ms(lambda: int8_mm(x, *w8, n), repeats)
            native.int8_isa(native.int8_isas_here()[0])
        out.append(entry)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="a GGUF-born target (default: the embedded preset)")
    ap.add_argument("--rows", default="1,4,9,16", help="comma-separated block sizes")
    ap.add_argument("--cache-len", type=int, default=300, help="committed positions before each forward's block")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per product and size (median kept)")
    ap.add_argument("--forward-repeats", type=int, default=7, help="timed forwards per size (median kept)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    try:
        rows = tuple(int(n) for n in args.rows.split(","))
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if min(rows) < 1 or args.cache_len < 1 or args.repeats < 1 or args.forward_repeats < 1:
        ap.error("--rows, --cache-len and the repeats must be positive")

    import torch

    from mcsd.costs.forward_profile import breakdown
    from mcsd.costs.profile import machine_info
    from mcsd.drafting.pair import load_model
    from mcsd.forward import native, quant
    from mcsd.loading.models import gguf_source
    from mcsd.loading.presets import DEFAULT_PRESET
    if args.threads:
        torch.set_num_threads(args.threads)
    if quant.kernel_name() != "native":
        ap.error(f"8-bit activations run on mcsd's native kernel, which is not used here ({native.reason()})")
    source = args.target or DEFAULT_PRESET
    report = {"target": source, "threads": torch.get_num_threads(), "cache_len": args.cache_len,
              "int8_isas": list(native.int8_isas_here()), "host": machine_info("cpu"), "products": [], "forward": {}}
    print(f"{source}, {torch.get_num_threads()} thread(s); 8-bit products on {', '.join(native.int8_isas_here())} "
          f"(first: the one used)")
    with torch.inference_mode():
        model = load_model(source, "float32", "cpu", weights="q4")
        report["products"] = products(model, rows, args.repeats)
        print("\nproducts alone, ms (x 1 row):")
        for p in report["products"]:
            print(f"  {p['kind']} {p['n']} x {p['k']}")
            for path, by_rows in p["ms"].items():
                one = by_rows[rows[0]]
                cells = "  ".join(f"{n}: {ms:.3f} (x{ms / one:.2f})" for n, ms in by_rows.items())
                print(f"    {path:18s} {cells}")
        print(f"\nforwards over {args.cache_len} cached positions, ms (x 1 row):")
        for weights in ("q4", "q4q8"):
            if weights == "q4q8":
                quant.detach(model)
                quant.attach(model, gguf_source(source), act8=True)
            results = breakdown(model, rows, cache_len=args.cache_len, repeats=args.forward_repeats)
            walls = {r.rows: r.wall_ms for r in results}
            report["forward"][weights] = walls
            one = walls[rows[0]]
            print(f"  {weights:5s} " + "  ".join(f"{n}: {ms:.2f} (x{ms / one:.2f})" for n, ms in walls.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
