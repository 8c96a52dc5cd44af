"""Running `mcsd-generate`: the models and decoder from the flags, one prompt or a prompts file, the
text, JSON, statistics and tree drawing it prints.
"""


from __future__ import annotations

import json
import sys
from pathlib import Path

from ..loading.presets import DEFAULT_PRESET, describe_presets
from .args import (UsageError, check_args, check_hub, check_window, drafter_kinds, drafts_nothing, parse_policy_options,
                   processing, settle_policy)


def _decode_utf8(data: bytes, source: str) -> str:
    """Strict UTF-8: a prompt is never silently altered; a bad byte is named with its offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{source} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
                         f"cannot be decoded (convert it first, e.g. with iconv -t UTF-8)") from None


def _read_prompt(args) -> str:
    if args.prompt is not None:       # argv arrives decoded; undecodable bytes survive as surrogates
        text = _decode_utf8(args.prompt.encode("utf-8", "surrogateescape"), "--prompt")
    elif args.prompt_file is not None:
        try:
            data = Path(args.prompt_file).read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read --prompt-file {args.prompt_file}: {exc.strerror}") from None
        text = _decode_utf8(data, f"--prompt-file {args.prompt_file}")
    elif sys.stdin is not None and not sys.stdin.isatty():
        stdin = getattr(sys.stdin, "buffer", None)
        data = stdin.read() if stdin is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
        text = _decode_utf8(data, "stdin")
    else:
        raise UsageError("no prompt: pass --prompt TEXT, --prompt-file FILE, or pipe text on stdin")
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


def _format_prompt(text: str, tokenizer, args) -> str:
    if not args.chat:
        return text
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("--chat was given but the target's tokenizer has no chat template")
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
               [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _stats_summary(stats, baseline: bool) -> str:
    lines = [f"{stats.new_tokens} tokens in {stats.wall_s:.2f}s: {stats.tokens_per_s:.1f} tokens/s",
             f"target forwards {stats.target_forwards}, tau (tokens per target forward) {stats.mean_accepted:.2f}"]
    if not baseline:
        lines.append(f"draft forwards {stats.draft_forwards}, rounds {stats.rounds}, "
                     f"mean tree size {stats.tree_nodes / max(stats.rounds, 1):.1f} nodes")
        if stats.accept_by_depth:                   # empty when no round drafted (--tree 0, or a gated policy)
            lines.append("acceptance by depth: " + " ".join(f"d{d + 1}={r:.2f}" for d, r in
                                                             enumerate(stats.accept_by_depth)))
        if stats.context_nodes:
            lines.append(f"context: {stats.context_nodes} nodes proposed, {stats.context_accepted} accepted")
        lines.append(f"time split: draft {stats.draft_s:.2f}s, verify {stats.verify_s:.2f}s, "
                     f"prefill {stats.prefill_s:.2f}s, other {stats.other_s:.2f}s")
    return "\n".join(lines)


# Why --dtype auto's "expected tokens/s" sits above the measured rate: it ranks dtypes, it does not forecast.
_EXPECTED_NOTE = ("  (expected tokens/s ranks the dtypes by a cost model, it is not a forecast of this run: it "
                  "assumes a fixed acceptance and chains, times forwards at a 200-token context, and leaves out the "
                  "prefill and each round's own work, all of which the measured tokens/s above include)")

_COSTS_SOURCES = {"cached": "this machine's calibrated profile (cached)",
                  "measured": "measured on this machine just now (cached for next time)",
                  "chosen": "this machine's calibrated profile, measured in this run for the dtype choice where "
                            "it was missing (cached for next time)",
                  "default": "generic defaults (not calibrated: --no-calibrate)"}


def _auto_dtype(target, draft, args):
    """--dtype auto (with --weights auto): the dtype and weights this pair and method run fastest in here;
    the pair converted to them."""
    from ..decoding.choice import apply_choice, choose_dtype
    from ..forward.quant import ON_CODES
    from ..loading.models import gguf_source
    if args.device != "cpu" and not str(args.device).startswith("cuda"):
        args.weights = "dense"
        return target, draft, "float32", "float32: --dtype auto measures on one cpu or cuda device only"
    from ..forward.attention import set_backend
    # the copies measured for each dtype run the attention the decoder will: one profile a dtype
    set_backend(target, args.attention)
    # --baseline runs the dtype and weights the default run would choose (so a comparison credits
    # speculation alone): chosen as that run chooses them, with its drafter, from the costs that run
    # cached; it measures nothing unless asked to (--calibrate), so before any default run has measured
    # them the fixed rule of an uncalibrated choice decides. A target with no default run is priced alone.
    alone = args.baseline and not _default_run_drafts(args)
    calibrate = False if args.baseline and args.calibrate is None else args.calibrate
    gguf = gguf_source(args.target or DEFAULT_PRESET) if args.weights in ("auto", *ON_CODES) else None
    choice = choose_dtype(target, draft, drafting=not alone, calibrate=calibrate,
                          free_draft=drafter_kinds(args)[2], borrow=alone, gguf=gguf, weights=args.weights)
    args.dtype_calibration_s, args.calibration_provisional = choice.calibration_s, choice.provisional
    args.dtype_measured = bool(calibrate)             # every candidate measured just now, the chosen one too
    args.weights = choice.weights
    if choice.dtype != "float32" or choice.weights != "dense":
        target, draft = apply_choice(target, draft, choice, gguf)
    reason = choice.reason
    if args.baseline and not alone:
        reason += ("; as the default run chooses it" if choice.measured else
                   "; the default run's costs are not cached yet, so the fixed rule chose (not a measurement: "
                   "run once without --baseline, or pass --calibrate)")
    return target, draft, choice.dtype, reason


def _default_run_drafts(args) -> bool:
    """The run without --baseline would draft: a --draft, a preset's drafter, or context alone."""
    from ..loading.presets import PRESETS
    return args.draft is not None or (args.target or DEFAULT_PRESET) in PRESETS or drafter_kinds(args)[2]


def load_models(args):
    """(target, draft or None, tokenizer) as the flags ask, in the dtype they are loaded in."""
    from ..drafting.pair import load_model, load_model_pair
    from ..forward import quant
    from ..loading.models import load_tokenizer

    _set_threads(args)
    if args.weights in quant.ON_CODES:
        from ..loading.models import parse_dtype
        allowed = quant.dtypes(args.weights)
        if not allowed:
            raise UsageError(f"--weights q4q8 runs on mcsd's native kernel, which is not used here "
                             f"({quant.describe_kernel()}); use --weights q4")
        if args.dtype == "auto" and (len(allowed) == 1 or args.device != "cpu"):
            args.dtype = allowed[0]
            args.dtype_fixed = (f"{args.dtype}: --weights {args.weights} computes in it alone here "
                                f"({quant.describe_kernel()})")
        elif args.dtype == "auto":
            from ..loading.models import gguf_source
            source = args.target or DEFAULT_PRESET
            if gguf_source(source) is None:         # loaded dense first, so said here rather than at the load
                raise UsageError(f"q4 weights are read from a Q4_1 GGUF file; {source!r} is neither one, nor a "
                                 f"preset, nor a directory converted from one")
        elif str(parse_dtype(args.dtype)).removeprefix("torch.") not in allowed:
            raise UsageError(f"--weights {args.weights} computes in {' or '.join(allowed)} here; drop --dtype "
                             f"{args.dtype} or pass --dtype {allowed[0]}")
    if args.weights == "auto" and (args.dtype != "auto" or args.device != "cpu"):
        args.weights = "dense"                      # auto weighs q4 against the dense dtypes, on the CPU only
    load_dtype = "float32" if args.dtype == "auto" else args.dtype
    # auto, or q4 with --dtype auto: loaded dense, the weights and dtype decided once calibrated
    load_weights = "dense" if args.weights == "auto" or args.dtype == "auto" else args.weights
    model_kind, _, context_only = drafter_kinds(args)
    # --baseline with --dtype auto loads the default run's draft too, to choose as that run does (dropped then)
    same_as_default = args.baseline and args.dtype == "auto" and _default_run_drafts(args)
    if (args.baseline and not same_as_default) or context_only:
        target_src = args.target or DEFAULT_PRESET
        tokenizer = load_tokenizer(target_src)
        return load_model(target_src, load_dtype, args.device, role="target", weights=load_weights), None, tokenizer
    return load_model_pair(args.target, args.draft, dtype=load_dtype, device=args.device, drafter=model_kind,
                           weights=load_weights)


def _check_lengths(args, target, tokenizer, prompts: list[str], draft=None) -> None:
    """Every prompt, with the tokens asked for, fits the target's context window; and is long enough
    for --lossy-target-roots with a drafter reading the target's features."""
    from ..config import SamplingConfig, check_context_window, check_lossy_roots
    window = getattr(target.config, "max_position_embeddings", None)
    reads_features = getattr(draft, "uses_target_hidden", False) and not args.baseline
    for prompt in prompts:
        n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        check_context_window(window, n, args.max_new_tokens)
        check_lossy_roots(args.lossy_target_roots, SamplingConfig(), n, reads_features, "--lossy-target-roots")


def build_decoder(args, target, draft, tokenizer):
    """(decoder, why this dtype or None): --dtype auto's choice, the context drafter, the decoder."""
    from ..decoding.decoder import TreeDecoder

    _, with_context, _ = drafter_kinds(args)
    dtype_reason = getattr(args, "dtype_fixed", None)
    calibrate = args.calibrate
    if args.dtype == "auto":
        target, draft, args.dtype, dtype_reason = _auto_dtype(target, draft, args)
        if getattr(args, "dtype_measured", False):
            calibrate = None                        # --calibrate's measurement of the chosen pair serves as cached
    if args.baseline:
        draft = None                                # loaded only to choose as the default run does
    if with_context and not args.baseline:
        from ..drafting.context import ContextDrafter
        context = ContextDrafter(store=Path(args.context_store).expanduser() if args.context_store else None)
        draft = context if draft is None else [draft, context]
    decoder = TreeDecoder(target, draft, tokenizer=tokenizer, tree=args.tree, policy=args.policy,
                          attention=args.attention, lossy_target_roots=args.lossy_target_roots,
                          calibrate=calibrate, policy_options=parse_policy_options(args.policy_option) or None,
                          cuda_graphs=args.cuda_graphs == "on",
                          threads=None,             # chosen by _set_threads before the models loaded
                          release_weights=True)     # the models are this command's own
    return decoder, dtype_reason


def _set_threads(args) -> None:
    """torch's thread count: --threads, else OMP_NUM_THREADS where set, else the free cores
    (`mcsd.forward.threads`, read over the start-up since `args.load_since`); the choice is kept in args."""
    from ..forward import threads
    if args.threads is not None:
        args.thread_choice = threads.explicit(args.threads, "--threads")
    else:
        args.thread_choice = threads.auto(getattr(args, "load_since", None))
    if args.thread_choice.clamped:
        print(f"mcsd-generate: note: threads {args.thread_choice.reason}; using {args.thread_choice.threads}",
              file=sys.stderr)
    threads.apply(args.thread_choice)


def _settings(args, decoder, dtype_reason) -> dict:
    """What actually ran: a baseline run has no tree, policy or drafter; a --tree 0 run no policy or drafter."""
    drafter = decoder.drafter
    drafted = not args.baseline and not drafts_nothing(args)
    kind = None if drafter is None else ("feature" if getattr(drafter, "uses_target_hidden", False) else "model")
    if decoder.context is not None:
        kind = "context" if kind is None else f"{kind}+context"
    return {"tree": args.tree if not args.baseline and drafter is not None else None,
            "policy": args.policy if drafted and drafter is not None else None,
            "drafter": kind if drafted else None,
            "dtype": args.dtype, "dtype_reason": dtype_reason, "weights": args.weights, "costs": decoder.costs_source,
            "matmul_kernels": decoder.kernels_note,
            "acceptance_model": getattr(decoder.policy, "model_source", None) if drafted else None,
            "round_prices": getattr(decoder, "round_prices", None) if drafted else None,
            "device": args.device, "attention": decoder.attention, "baseline": args.baseline,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
            "min_p": args.min_p, "typical_p": args.typical_p, **processing(args),
            "lossy_target_roots": args.lossy_target_roots,
            "threads": args.thread_choice.threads, "threads_reason": args.thread_choice.reason,
            "calibration_s": round(decoder.calibration_s + getattr(args, "dtype_calibration_s", 0.0), 2),
            "context": _context_settings(decoder) if drafted else None}


def _context_settings(decoder) -> dict | None:
    """The context drafter's sources and their measured acceptance, or None without one."""
    if decoder.context is None:
        return None
    from ..drafting.context import describe
    return describe(decoder.context)


def run(args) -> int:
    if args.list_models:
        print("\n".join(describe_presets()))
        return 0
    from ..forward.threads import snapshot
    args.load_since = snapshot()                    # other processes' CPU use is read from here to the load
    from ..drafting import pearl  # noqa: F401  (registers the "pearl" execution mode)
    parse_policy_options(args.policy_option)        # a malformed setting fails before anything loads
    settle_policy(args, drafting=not args.baseline and not drafter_kinds(args)[2])
    check_args(args)                               # fail on a malformed flag before loading anything
    if args.prompts_file is not None:
        texts = _read_prompts_file(args.prompts_file)
    else:
        texts = [_read_prompt(args)]
    check_hub(args)
    check_window(args)                              # the target's config, read before its weights
    target, draft, tokenizer = load_models(args)
    prompts = [_format_prompt(text, tokenizer, args) for text in texts]
    _check_lengths(args, target, tokenizer, prompts, draft)  # before any calibration: a bad input costs nothing
    decoder, dtype_reason = build_decoder(args, target, draft, tokenizer)
    if args.prompts_file is not None:
        if not args.chat and getattr(tokenizer, "chat_template", None):
            print("mcsd-generate: note: the prompts go to the target as plain text to continue; its tokenizer "
                  "has a chat template, and a chat model answers a prompt given as a chat turn: add --chat",
                  file=sys.stderr)
        return _run_many(args, decoder, prompts)
    prompt = prompts[0]

    printed = {"text": ""}
    streamed: list[int] = []                          # every token so far: printed on Ctrl-C

    def stream_text(new_tokens):
        streamed.extend(new_tokens)
        if not args.stream or args.json:
            return
        full = tokenizer.decode(streamed, skip_special_tokens=True)
        if not full.endswith("\ufffd"):                   # wait for a complete multi-byte character
            sys.stdout.write(full[len(printed["text"]):])
            sys.stdout.flush()
            printed["text"] = full

    rounds = []
    common = dict(_options(args), streamer=stream_text)
    try:
        if args.baseline:
            out = decoder.generate_baseline(prompt, **common)
        else:
            out = decoder.generate(prompt, on_round=(lambda t, a: rounds.append((t, a))) if args.show_tree else None,
                                   **common)
    except KeyboardInterrupt as stop:                 # Ctrl-C or SIGTERM: keep what was generated
        text = tokenizer.decode(streamed, skip_special_tokens=True)
        if args.json:                                 # still one JSON object, marked as cut short
            sys.stdout.write(json.dumps({"text": text, "tokens": streamed, "finish_reason": "interrupted",
                                         "settings": _settings(args, decoder, dtype_reason)}) + "\n")
        else:
            sys.stdout.write(text[len(printed["text"]):] + "\n")
        sys.stdout.flush()
        print(f"mcsd-generate: {_interruption(stop)} after {len(streamed)} tokens", file=sys.stderr)
        return getattr(stop, "exit_code", 130)
    if args.json:
        result = {"text": out.text, "tokens": out.tokens, "finish_reason": out.finish_reason,
                  "stats": out.stats.as_dict(), "settings": _settings(args, decoder, dtype_reason)}
        if args.logprobs:
            result["logprobs"] = out.logprobs
        print(json.dumps(result))
    elif args.stream:
        sys.stdout.write(out.text[len(printed["text"]):] + "\n")
    else:
        print(out.text)
    if args.lossy_target_roots:
        print("mcsd-generate: warning: --lossy-target-roots changed the output distribution (not lossless)",
              file=sys.stderr)
    if out.finish_reason == "eos" and len(out.tokens) <= 1 and not args.chat \
            and getattr(tokenizer, "chat_template", None):
        print("mcsd-generate: note: the target ended the text at its first token; its tokenizer has a chat "
              "template, and a chat model answers a prompt given as a chat turn: add --chat", file=sys.stderr)
    if args.stats:
        print(_stats_summary(out.stats, args.baseline), file=sys.stderr)
        print(f"dtype: {dtype_reason or args.dtype + ' (as asked)'}", file=sys.stderr)
        print(f"weights: {args.weights}", file=sys.stderr)
        print(f"threads: {args.thread_choice.reason}", file=sys.stderr)
        spent = decoder.calibration_s + getattr(args, "dtype_calibration_s", 0.0)
        busy = decoder.calibration_note or ("; provisional: measured on a busy machine"
                                            if getattr(args, "calibration_provisional", False) else "")
        if spent or busy:
            print(f"calibration: {spent:.1f}s measuring this machine's costs in this run{busy}", file=sys.stderr)
        if dtype_reason and "expected tokens/s" in dtype_reason:
            print(_EXPECTED_NOTE, file=sys.stderr)
        if decoder.kernels_note is not None:
            print(f"matmul kernels: {decoder.kernels_note}", file=sys.stderr)
        print(f"round: {out.stats.round} ({out.stats.round_reason})", file=sys.stderr)
        blocks = decoder.target.blocks
        if blocks is not None and blocks.capture:
            print(f"cuda graphs: {blocks.captures} captured in {blocks.capture_s:.2f}s", file=sys.stderr)
        elif blocks is not None and blocks.failure:
            print(f"cuda graphs: off ({blocks.failure}); the same shapes ran eagerly", file=sys.stderr)
        head_blocks = decoder.fixed_round.blocks if decoder.fixed_round is not None else None
        if out.stats.round == "fixed" and head_blocks is not None and (head_blocks.captures or head_blocks.failure):
            print(f"head's cuda graphs: {head_blocks.captures} captured in {head_blocks.capture_s:.2f}s"
                  + (f"; off ({head_blocks.failure})" if head_blocks.failure else ""), file=sys.stderr)
        from ..costs.forward_profile import resident_bytes
        from ..costs.profile import drafter_module
        held = resident_bytes(decoder.target.model, drafter_module(decoder.drafter) if decoder.drafter else None)
        print("weights resident: " + ", ".join(f"{n / 1e6:.0f} MB {form}" for form, n in held.items() if n),
              file=sys.stderr)
        own = "the engine's own (Llama family)" if decoder.target.path == "lean" else "transformers'"
        print(f"forward: {own}", file=sys.stderr)
        from ..forward.attention import describe as describe_attention
        print(f"attention: {describe_attention(decoder.attention)}; KV cache written in place", file=sys.stderr)
        if decoder.costs_source is not None:
            costs = getattr(decoder.policy, "costs", None) or decoder.context_costs
            online = ", corrected online" if getattr(costs, "online", False) else ", fixed for the run"
            stale = getattr(costs, "stale", None)
            stale = f"; stale, measured again at the next quiet start: {stale}" if stale else ""
            print(f"costs: {_COSTS_SOURCES[_costs_source(decoder, args)]}{online}{stale}{_borrowed_note()}",
                  file=sys.stderr)
            if getattr(decoder, "round_prices", None) and not args.baseline:
                print(f"round prices: {decoder.round_prices}", file=sys.stderr)
        if not args.baseline and getattr(decoder.policy, "model_source", None) is not None:
            print(f"acceptance model: {decoder.policy.model_source}", file=sys.stderr)
    if args.show_tree and rounds:
        _draw_best_round(rounds, args.show_tree, tokenizer)
    return 0


def _costs_source(decoder, args) -> str:
    """Where the costs came from, as --stats says it: a profile the dtype choice measured in this run is
    read back from the cache by the decoder, and is no older profile."""
    if decoder.costs_source == "cached" and (getattr(args, "dtype_calibration_s", 0.0) > 0
                                             or getattr(args, "dtype_measured", False)):
        return "chosen"
    return decoder.costs_source


def _borrowed_note() -> str:
    """Where the costs were measured for another thread count (this run's count lowered by other
    processes' load: `mcsd.costs.store.load_cached`), that note for --stats."""
    from ..costs.store import borrowed_counts
    counts = borrowed_counts()
    if not counts:
        return ""
    n = " and ".join(map(str, counts))
    return (f"; measured for {n} thread{'s' if counts != [1] else ''}, which serve while other processes keep "
            f"cores busy (not measured again at the lowered count)")


def _options(args) -> dict:
    """The generation keywords the flags ask for (unset ones left out)."""
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop_strings=tuple(args.stop), min_p=args.min_p,
                   typical_p=args.typical_p, **processing(args))
    if args.logprobs:
        options["return_logprobs"] = True
    return {k: v for k, v in options.items() if v is not None}


def _read_prompts_file(path: str) -> list[str]:
    """The prompts of a JSONL file: each line's "prompt" or "text" field, or the first of its "turns"."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read --prompts-file {path}: {exc.strerror}") from None
    texts = []
    for n, line in enumerate(_decode_utf8(data, f"--prompts-file {path}").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"--prompts-file {path}:{n}: not JSON ({exc})") from None
        text = None
        if isinstance(row, dict):
            text = row.get("prompt", row.get("text"))
            turns = row.get("turns")
            if text is None and isinstance(turns, list) and turns:
                text = turns[0]
        if not isinstance(text, str) or not text.strip():
            raise UsageError(f"--prompts-file {path}:{n}: expected an object with a non-empty \"prompt\" or "
                             f"\"text\" string, or a \"turns\" list")
        texts.append(text)
    if not texts:
        raise UsageError(f"--prompts-file {path} holds no prompts")
    return texts


def _run_many(args, decoder, prompts: list[str]) -> int:
    """Generate for each prompt in turn, one JSON result a line, with a progress bar on a terminal."""
    from ..loading.progress import bars_wanted
    sink = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    generate = decoder.generate_baseline if args.baseline else decoder.generate
    bar = None
    if bars_wanted():
        from tqdm import tqdm
        bar = tqdm(total=len(prompts), desc="prompts", unit="prompt", file=sys.stderr)
    done = 0
    try:
        for i, prompt in enumerate(prompts):
            out = generate(prompt, **_options(args))
            row = {"index": i, "text": out.text, "tokens": out.tokens, "finish_reason": out.finish_reason,
                   "stats": out.stats.as_dict()}
            if args.logprobs:
                row["logprobs"] = out.logprobs
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            done += 1
            if bar is not None:
                bar.update(1)
    except KeyboardInterrupt as stop:
        print(f"mcsd-generate: {_interruption(stop)} after {done} of {len(prompts)} prompts", file=sys.stderr)
        return getattr(stop, "exit_code", 130)
    finally:
        if bar is not None:
            bar.close()
        if sink is not sys.stdout:
            sink.close()
    if args.stats:
        print(f"{done} prompts", file=sys.stderr)
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is (as Ctrl-C's KeyboardInterrupt is), so a stopped run still prints
    the text so far; the command exits with 128 + 15, as a process ended by the signal would."""
    exit_code = 128 + 15


def _interruption(stop: KeyboardInterrupt) -> str:
    return "stopped by SIGTERM" if isinstance(stop, Terminated) else "interrupted"


def _draw_best_round(rounds, path: str, tokenizer) -> None:
    from ..core.viz import draw_tree
    best = max(range(len(rounds)), key=lambda i: (rounds[i][1].n_accepted, -i))
    try:
        written = draw_tree(*rounds[best], path, tokenizer,
                            title=f"round {best + 1} of {len(rounds)}: {rounds[best][0].size - 1} draft nodes, "
                                  f"{rounds[best][1].n_accepted} accepted")
    except OSError as exc:
        raise UsageError(f"cannot write --show-tree {path}: {exc.strerror or exc}") from None
    print(f"tree drawn to {written}", file=sys.stderr)
