"""The q4 target's forward and products by rows, on float32 activations ("q4") and on 8-bit ones
("q4q8"), each of the latter's instruction sets this CPU has: what decides whether the integer
products pay here. Run it on a quiet machine (nothing else on the cores):

    python tools/profile_q8.py                       # the embedded target, 1 / 4 / 9 / 16 rows
    python tools/profile_q8.py --threads 2 --rows 1,2,4,9,16 --cache-len 300 --json q8.json
    python tools/profile_q8.py --rows 1,2,4,8,16,32 --isas amx,avx512vnni --no-products   # tiles or VNNI

First the products alone (each weight shape of the target's layers and its LM head, median of
`--repeats` calls; the same bits on every instruction set, so only the time differs), then whole
forwards over a `--cache-len` cache: on float32 activations through `mcsd.costs.forward_profile.breakdown`
(the engine's forward), on 8-bit ones once per instruction set, each size on every set in turn, round
by round (`--forward-repeats` rounds; the median and the least kept), so that a busy machine slows them
alike. Each with its cost relative to 1 row. Which path the command line runs is not decided here:
the calibrated costs weigh "q4/float32" against "q4q8/float32" (`mcsd.decoding.choice`).
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


def products(model, rows: tuple[int, ...], repeats: int, isas: tuple[str, ...]) -> list[dict]:
    """Per weight shape of `model` (attached on float32 activations), ms of one product by rows, on
    float32 activations and on 8-bit ones with each of `isas`."""
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
            for isa in isas:
                native.int8_isa(isa)
                entry["ms"].setdefault(f"int8 {isa}", {})[rows_n] = _median_ms(lambda: int8_mm(x, *w8, n), repeats)
            native.int8_isa(native.int8_isas_here()[0])
        out.append(entry)
    return out


def interleaved_forwards(model, rows: tuple[int, ...], isas: tuple[str, ...], cache_len: int,
                         rounds: int) -> dict[str, dict[str, dict[int, float]]]:
    """ms of a forward of each block size over a `cache_len` cache on each of `isas` (the model on
    8-bit activations), every round running each size on each set in turn: {"median" | "min": {isa:
    {rows: ms}}}."""
    import torch

    from mcsd.forward import native
    from mcsd.forward.attention import causal_allowed
    from mcsd.forward.lm import CachedLM
    lm = CachedLM(model, in_place=True)
    gen = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    lm.reset()
    lm.extend(torch.randint(0, vocab, (cache_len,), generator=gen), last_logits=True)

    def step(n: int) -> float:
        tokens = torch.randint(0, vocab, (n,), generator=gen)
        t0 = time.perf_counter()
        lm.forward(tokens, torch.arange(cache_len, cache_len + n), causal_allowed(n, lm.device))
        ms = (time.perf_counter() - t0) * 1000
        lm.commit(cache_len, torch.zeros(0, dtype=torch.long))                # back to the prefix
        return ms

    times = {isa: {n: [] for n in rows} for isa in isas}
    for r in range(rounds + 1):                                   # round 0: warm-up
        for n in rows:
            # each size on every set in turn, the sets' order reversed every other round: a forward runs
            # slower after some others (after a 32-row one on AVX512-VNNI, a 1-row one took 5% longer)
            for isa in isas if r % 2 else isas[::-1]:
                native.int8_isa(isa)
                ms = step(n)
                if r:
                    times[isa][n].append(ms)
    native.int8_isa(native.int8_isas_here()[0])
    return {kind: {isa: {n: pick(ts) for n, ts in by_rows.items()} for isa, by_rows in times.items()}
            for kind, pick in (("median", statistics.median), ("min", min))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="a GGUF-born target (default: the embedded preset)")
    ap.add_argument("--rows", default="1,4,9,16", help="comma-separated block sizes")
    ap.add_argument("--cache-len", type=int, default=300, help="committed positions before each forward's block")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per product and size (median kept)")
    ap.add_argument("--forward-repeats", type=int, default=7, help="timed forwards per size (median kept)")
    ap.add_argument("--isas", help="comma-separated instruction sets of the 8-bit products to time (default: "
                                   "every one this CPU runs; see mcsd.forward.native.int8_isas_here)")
    ap.add_argument("--no-products", action="store_true", help="time the forwards only")
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
    here = native.int8_isas_here()
    isas = tuple(args.isas.split(",")) if args.isas else here
    for isa in isas:
        if native.int8_isa_absent(isa) is not None:
            ap.error(f"--isas: the 8-bit products cannot run on {isa!r} here: {native.int8_isa_absent(isa)}")
    source = args.target or DEFAULT_PRESET
    report = {"target": source, "threads": torch.get_num_threads(), "cache_len": args.cache_len,
              "int8_isas": list(here), "timed_isas": list(isas), "host": machine_info("cpu"),
              "native": native.reason(), "products": [], "forward": {}}
    print(f"{source}, {torch.get_num_threads()} thread(s); 8-bit products on {', '.join(here)} "
          f"(first: the one used); timed on {', '.join(isas)}")
    with torch.inference_mode():
        model = load_model(source, "float32", "cpu", weights="q4")
        if not args.no_products:
            report["products"] = products(model, rows, args.repeats, isas)
            print("\nproducts alone, ms (x 1 row):")
            for p in report["products"]:
                print(f"  {p['kind']} {p['n']} x {p['k']}")
                for path, by_rows in p["ms"].items():
                    one = by_rows[rows[0]]
                    cells = "  ".join(f"{n}: {ms:.3f} (x{ms / one:.2f})" for n, ms in by_rows.items())
                    print(f"    {path:18s} {cells}")
        print(f"\nforwards over {args.cache_len} cached positions, ms (x 1 row):")
        results = breakdown(model, rows, cache_len=args.cache_len, repeats=args.forward_repeats)
        report["forward"]["q4"] = walls = {r.rows: r.wall_ms for r in results}
        print(f"  {'q4':16s} " + "  ".join(f"{n}: {ms:.2f} (x{ms / walls[rows[0]]:.2f})" for n, ms in walls.items()))
        quant.detach(model)
        quant.attach(model, gguf_source(source), act8=True)
        timed = interleaved_forwards(model, rows, isas, args.cache_len, args.forward_repeats)
        report["forward_min"] = {}
        for isa in isas:
            report["forward"][f"q4q8 {isa}"] = walls = timed["median"][isa]
            report["forward_min"][f"q4q8 {isa}"] = least = timed["min"][isa]
            print(f"  {'q4q8 ' + isa:16s} " + "  ".join(f"{n}: {ms:.2f} (x{ms / walls[rows[0]]:.2f})"
                                                       for n, ms in walls.items())
                  + "   least: " + "  ".join(f"{n}: {ms:.2f}" for n, ms in least.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
