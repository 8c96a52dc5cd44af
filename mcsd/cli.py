"""`mcsd-generate`: command-line front end. Flags map onto the library's arguments, nothing else.

User mistakes (bad flags, malformed or oversized tree, missing model, mismatched
tokenizers, prompts past the context window, undecodable prompt bytes, a cache
that cannot be written, ...) print one clear line and exit with 2.

Start-up: nothing heavy is imported at module level (torch and transformers
load only when a model does), so `--list-models`, `--help` and argument
mistakes answer at once.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

from .config import (
    ATTENTION_BACKENDS,
    DTYPE_NAMES,
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    WEIGHTS,
    ConfigError,
    DecodeConfig,
    ProcessingConfig,
    SamplingConfig,
    check_lossy_roots,
)
from .errors import ModelLoadError
from .loading.presets import DEFAULT_PRESET, DRAFTERS, PRESETS, describe_presets, parse_drafter_spec
from .loading.sources import is_local_path_syntax

DRAFTER_CHOICES = (*DRAFTERS, "context", *(f"{d}+context" for d in DRAFTERS))


class _Parser(argparse.ArgumentParser):
    """argparse that reports a mistake in one line, without the usage block, like every other mistake."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_arguments(parser: argparse.ArgumentParser):
    """The flags that choose the model pair and how the decoder runs it, shared by `mcsd-generate` and
    `mcsd-serve`. Returns the two argument groups ("models", "decoder")."""
    src = parser.add_argument_group("models")
    src.add_argument("--target", help="target: preset name, model directory, .gguf file or hub id")
    src.add_argument("--draft", help="draft: model directory, .gguf file or hub id (same tokenizer as the target)")
    default_drafter = PRESETS[DEFAULT_PRESET].default_drafter
    src.add_argument("--drafter", default=None, choices=DRAFTER_CHOICES,
                     help=f"with a preset: 'feature' (a head reading the target's features) or 'model' (a "
                          f"standalone draft LM), alone; 'context' drafts for free from the prompt, the output "
                          f"so far and the target's recycled predictions (no draft model, any target); "
                          f"'feature+context' / 'model+context' merge both into one tree. Default: the preset's "
                          f"faster drafter ({default_drafter!r} for {DEFAULT_PRESET}), or --draft, with context "
                          f"merged in")
    src.add_argument("--context-store", metavar="FILE",
                     help="with a context drafter: also look up continuations in this datastore of earlier "
                          "outputs (built by tools/build_context_store.py; safetensors, never unpickled)")
    src.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_NAMES),
                     help="compute dtype (default auto: the one this pair and method run fastest in on this "
                          "machine, from its calibrated costs)")
    src.add_argument("--weights", default="auto", choices=("auto", *WEIGHTS),
                     help="q4: run the target's linear layers on the 4-bit codes of the Q4_1 GGUF it comes from "
                          "(the embedded preset's, or a .gguf target), as llama.cpp does; CPU only, in float32 or "
                          "bfloat16 as the kernel and CPU suit (--stats says), exact with respect to q4 decoding. "
                          "dense: the dequantised weights. Default auto: "
                          "with --dtype auto, whichever of the two the calibrated costs say runs faster here (dense "
                          "for a target that is no GGUF, or with another --dtype)")
    src.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (spread the target over GPUs)")
    src.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS, help="tree attention backend")
    src.add_argument("--cuda-graphs", default="on", choices=("on", "off"),
                     help="on CUDA, capture the engine's own forward once per block size as a CUDA graph and "
                          "replay it (default on); off runs the same shapes eagerly, for debugging")
    src.add_argument("--threads", type=int, default=None,
                     help="CPU threads for torch (default: the cores free of other processes' work, at least 1; "
                          "OMP_NUM_THREADS, where set, is kept)")

    dec = parser.add_argument_group("decoder")
    dec.add_argument("--tree", default=None,
                     help=f"tree spec: k-config such as 4,2,2 (1,1,1,1 is a chain), at most {MAX_TREE_NODES} "
                          f"draft nodes and {MAX_TREE_DEPTH} levels; 0 = no drafting (plain target steps); with "
                          f"a dynamic policy, the largest tree it may grow (default: the policy's own)")
    dec.add_argument("--policy", default="auto",
                     help="tree policy: static, heuristic, confidence, learned, svip, disco, specdecpp, or the "
                          "pearl execution mode (default auto: learned when its acceptance model is installed, "
                          "else static)")
    dec.add_argument("--policy-option", action="append", default=[], metavar="NAME=VALUE",
                     help="a policy setting, e.g. h=0.4 (svip, specdecpp), threshold=0.1 (disco), "
                          "post_verify=false (pearl); repeatable")
    dec.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                     help="--calibrate measures this machine's costs (and, in bfloat16 on a CPU with native bf16, "
                          "which matmul path each block size runs faster on) again; --no-calibrate never measures "
                          "(cached costs, else generic ones). Default: measure once per machine, pair, dtype and "
                          "threads")
    dec.add_argument("--lossy-target-roots", type=int, default=0, metavar="W",
                     help="LOSSY opt-in (the MCSD paper's variant): W candidate roots from the target's top-W, "
                          "longest accepted branch kept; output may differ from the target's own; greedy only")
    return src, dec


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="mcsd-generate",
        description="Generate text with lossless multi-candidate tree speculative decoding. "
                    f"Without --target/--draft the embedded pair {DEFAULT_PRESET!r} is used.")
    src, _ = add_model_arguments(p)
    src.add_argument("--list-models", action="store_true", help="list the built-in presets and their drafters, "
                                                                "and exit")

    inp = p.add_argument_group("prompt")
    inp.add_argument("--prompt", help="prompt text (default: read --prompt-file, else stdin); UTF-8")
    inp.add_argument("--prompt-file", help="read the prompt from this file (UTF-8)")
    inp.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the chat template")
    inp.add_argument("--system", help="system message for --chat")
    inp.add_argument("--prompts-file", metavar="FILE.jsonl",
                     help="several prompts, one JSON object a line with a \"prompt\" or \"text\" field (or "
                          "Spec-Bench rows: the first of \"turns\"); generated one after another, one JSON result "
                          "a line to stdout or --output")

    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off (default)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    gen.add_argument("--min-p", type=float, default=None, help="sampling: drop tokens below MIN_P x the top one's "
                                                               "probability")
    gen.add_argument("--typical-p", type=float, default=None, help="sampling: locally typical mass in (0, 1]")
    gen.add_argument("--repetition-penalty", type=float, default=None,
                     help="penalise tokens already in the sequence (> 1), as transformers does; exact: applied at "
                          "every tree node with its own prefix")
    gen.add_argument("--no-repeat-ngram-size", type=int, default=None, help="never repeat an n-gram of this size")
    gen.add_argument("--min-new-tokens", type=int, default=None, help="no EOS before this many new tokens")
    gen.add_argument("--baseline", action="store_true", help="plain target-only decoding, for comparison")

    out = p.add_argument_group("output")
    out.add_argument("--stream", action="store_true", help="print text as it is accepted")
    out.add_argument("--stats", action="store_true", help="print tokens/s, tau and acceptance by depth to stderr")
    out.add_argument("--json", action="store_true", help="print one JSON object with text, tokens and stats")
    out.add_argument("--logprobs", action="store_true",
                     help="with --json or --prompts-file: the target's log-probability of each new token")
    out.add_argument("--output", metavar="FILE.jsonl", help="with --prompts-file: write the results here")
    out.add_argument("--show-tree", metavar="FILE.png",
                     help="draw the round with the longest accepted path (needs matplotlib)")
    return p


class UsageError(Exception):
    pass


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
                  "default": "generic defaults (not calibrated: --no-calibrate)"}


def _auto_dtype(target, draft, args):
    """--dtype auto (with --weights auto): the dtype and weights this pair and method run fastest in here;
    the pair converted to them."""
    from .decoding.choice import apply_choice, choose_dtype
    from .loading.models import gguf_source
    if args.device != "cpu" and not str(args.device).startswith("cuda"):
        args.weights = "dense"
        return target, draft, "float32", "float32: --dtype auto measures on one cpu or cuda device only"
    from .forward.attention import set_backend
    # the copies measured for each dtype run the attention the decoder will: one profile a dtype
    set_backend(target, args.attention)
    # --baseline needs no costs: it measures nothing unless asked to (--calibrate)
    calibrate = False if args.baseline and args.calibrate is None else args.calibrate
    gguf = gguf_source(args.target or DEFAULT_PRESET) if args.weights == "auto" else None
    choice = choose_dtype(target, draft, drafting=not args.baseline, calibrate=calibrate,
                          free_draft=_drafter_kinds(args)[2], borrow=args.baseline, gguf=gguf)
    args.dtype_calibration_s, args.calibration_provisional = choice.calibration_s, choice.provisional
    args.weights = choice.weights
    if choice.dtype != "float32" or choice.weights != "dense":
        target, draft = apply_choice(target, draft, choice, gguf)
    return target, draft, choice.dtype, choice.reason


def _check_sources(args) -> None:
    """A model given as a path that does not exist is named as such, before anything else about it."""
    for flag, source in (("--target", args.target), ("--draft", args.draft)):
        if source is not None and source not in PRESETS and is_local_path_syntax(source) \
                and not Path(source).expanduser().exists():
            raise UsageError(f"{flag} {source}: model path does not exist")


def _hub_ids(args) -> list[tuple[str, str]]:
    """(flag, id) for each model source that can only be a Hugging Face Hub id."""
    from .loading.sources import is_hub_id
    return [(flag, src) for flag, src in (("--target", args.target), ("--draft", args.draft))
            if src is not None and is_hub_id(src)]


def _check_hub(args) -> None:
    """Hub ids without a network: load from the local cache in offline mode (no retries), or stop at once
    with one line when a model is not cached (`mcsd.loading.sources.prepare_hub`)."""
    from .loading.sources import prepare_hub
    prepare_hub(_hub_ids(args))


def _check_args(args) -> None:
    """Every mistake that needs no model, found before anything is loaded."""
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    _check_sources(args)
    if args.lossy_target_roots < 0:
        raise UsageError(f"--lossy-target-roots must be >= 0, got {args.lossy_target_roots}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.weights == "q4" and args.device != "cpu":
        raise UsageError(f"--weights q4 runs on the CPU; drop --device {args.device}")
    if (args.target is not None and args.draft is None and args.target not in PRESETS and not args.baseline
            and args.drafter != "context"):
        from .loading.sources import check_source
        check_source(args.target, "--target")         # what is wrong with the target comes first
        raise UsageError(f"--target {args.target} needs a --draft (or use --baseline, --drafter context, or a "
                         f"preset: {', '.join(PRESETS)})")
    if args.draft is not None and args.target is None:
        raise UsageError(f"--draft needs --target: a draft is checked against the target whose tokenizer it "
                         f"shares; name that target (a preset works: --target {DEFAULT_PRESET} --draft DIR)")
    if args.output is not None and args.prompts_file is None:
        raise UsageError("--output writes --prompts-file results; for one prompt, redirect stdout")
    if args.output is not None:
        _check_writable(args.output, "--output")
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("--prompt and --prompt-file both give the prompt; pass one of them")
    if args.prompts_file is not None and (args.prompt is not None or args.prompt_file is not None):
        raise UsageError("--prompts-file takes the prompts from the file; drop --prompt / --prompt-file")
    if args.prompts_file is not None and args.show_tree:
        raise UsageError("--show-tree draws one generation; it does not combine with --prompts-file")
    model_kind, with_context, context_only = _drafter_kinds(args)
    if args.context_store is not None:
        if not with_context:
            raise UsageError("--context-store needs a context drafter (--drafter context, feature+context or "
                             "model+context)")
        if not Path(args.context_store).expanduser().is_file():
            raise UsageError(f"--context-store {args.context_store}: no such file")
    if with_context and args.lossy_target_roots:
        raise UsageError("--drafter with context is exact-only; it cannot be combined with --lossy-target-roots")
    if with_context and args.policy == "pearl":
        raise UsageError("--policy pearl drafts a chain with a draft model; it cannot take a context drafter")
    if context_only and args.draft is not None:
        raise UsageError("--drafter context uses no draft model; drop --draft, or use model+context")
    if args.show_tree:
        if args.baseline:
            raise UsageError("--show-tree draws a draft tree; it has none with --baseline")
        png = Path(args.show_tree).expanduser()
        if png.suffix.lower() != ".png":
            raise UsageError(f"--show-tree writes a PNG image: name it FILE.png, not {args.show_tree}")
        if not png.parent.is_dir():
            raise UsageError(f"cannot write --show-tree {args.show_tree}: no directory {png.parent}")
    from .core.tree import parse_tree_spec
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, seed=args.seed, stop_strings=tuple(args.stop),
                          sampling=SamplingConfig(args.temperature, args.top_k, args.top_p, args.min_p or 0.0,
                                                  1.0 if args.typical_p is None else args.typical_p),
                          processing=ProcessingConfig(**{k: v for k, v in _processing(args).items()
                                                         if v is not None}))
    if not args.baseline:
        check_lossy_roots(args.lossy_target_roots, decode.sampling)
    parse_tree_spec(args.tree)
    if (args.lossy_target_roots or args.policy == "pearl") and not args.baseline \
            and (any(v is not None for v in _processing(args).values()) or args.logprobs):
        raise UsageError("--repetition-penalty, --no-repeat-ngram-size, --min-new-tokens and --logprobs need the "
                         "exact tree loop; not with --lossy-target-roots or --policy pearl")


def _check_writable(path: str, flag: str) -> None:
    """A file the run will write can be written, found before any model loads (one that did not exist
    is not left behind)."""
    target = Path(path).expanduser()
    existed = target.exists()
    try:
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write {flag} {path}: {exc.strerror or exc}") from None
    if not existed:
        target.unlink(missing_ok=True)


def _processing(args) -> dict:
    return {"repetition_penalty": args.repetition_penalty, "no_repeat_ngram_size": args.no_repeat_ngram_size,
            "min_new_tokens": args.min_new_tokens}


def _drafter_kinds(args) -> tuple[str | None, bool, bool]:
    """(the model drafter's kind, None for the preset's default or none; whether context drafting is
    on; whether it is context alone). Without --drafter: the preset's (or --draft's) drafter with
    context merged in, except where context cannot join (--lossy-target-roots, the pearl mode) or
    nothing is to be drafted (--tree 0)."""
    if args.drafter is None:
        no_drafting = args.tree is not None and args.tree.strip() in ("", "0")
        return None, not (args.lossy_target_roots or args.policy == "pearl" or no_drafting), False
    kind, context = parse_drafter_spec(args.drafter)
    return kind, context, kind is None


def _load_models(args):
    """(target, draft or None, tokenizer) as the flags ask, in the dtype they are loaded in."""
    from .drafting.pair import load_model, load_model_pair
    from .loading.models import load_tokenizer

    _set_threads(args)
    if args.weights == "q4":
        from .forward import quant
        from .loading.models import parse_dtype
        allowed = quant.dtypes()
        if args.dtype == "auto":
            args.dtype = quant.compute_dtype()
            args.dtype_fixed = f"{args.dtype}: --weights q4 computes in it here ({quant.describe_kernel()})"
        elif str(parse_dtype(args.dtype)).removeprefix("torch.") not in allowed:
            raise UsageError(f"--weights q4 computes in {' or '.join(allowed)} here; drop --dtype {args.dtype} "
                             f"or pass --dtype {allowed[0]}")
    if args.weights == "auto" and (args.dtype != "auto" or args.device != "cpu"):
        args.weights = "dense"                      # auto weighs q4 against the dense dtypes, on the CPU only
    load_dtype = "float32" if args.dtype == "auto" else args.dtype
    load_weights = "dense" if args.weights == "auto" else args.weights   # auto: decided once calibrated
    model_kind, _, context_only = _drafter_kinds(args)
    if args.baseline or context_only:
        target_src = args.target or DEFAULT_PRESET
        tokenizer = load_tokenizer(target_src)
        return load_model(target_src, load_dtype, args.device, role="target", weights=load_weights), None, tokenizer
    return load_model_pair(args.target, args.draft, dtype=load_dtype, device=args.device, drafter=model_kind,
                           weights=load_weights)


def _check_lengths(args, target, tokenizer, prompts: list[str]) -> None:
    """Every prompt, with the tokens asked for, fits the target's context window."""
    from .config import check_context_window
    window = getattr(target.config, "max_position_embeddings", None)
    for prompt in prompts:
        n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        check_context_window(window, n, args.max_new_tokens)


def _build_decoder(args, target, draft, tokenizer):
    """(decoder, why this dtype or None): --dtype auto's choice, the context drafter, the decoder."""
    from .decoding.decoder import TreeDecoder

    _, with_context, _ = _drafter_kinds(args)
    dtype_reason = getattr(args, "dtype_fixed", None)
    if args.dtype == "auto":
        target, draft, args.dtype, dtype_reason = _auto_dtype(target, draft, args)
    if with_context and not args.baseline:
        from .drafting.context import ContextDrafter
        context = ContextDrafter(store=Path(args.context_store).expanduser() if args.context_store else None)
        draft = context if draft is None else [draft, context]
    decoder = TreeDecoder(target, draft, tokenizer=tokenizer, tree=args.tree, policy=args.policy,
                          attention=args.attention, lossy_target_roots=args.lossy_target_roots,
                          calibrate=args.calibrate, policy_options=parse_policy_options(args.policy_option) or None,
                          cuda_graphs=args.cuda_graphs == "on",
                          threads=None)             # chosen by _set_threads before the models loaded
    return decoder, dtype_reason


def _set_threads(args) -> None:
    """torch's thread count: --threads, else OMP_NUM_THREADS where set, else the free cores
    (`mcsd.forward.threads`, read over the start-up since `args.load_since`); the choice is kept in args."""
    import torch

    from .forward import threads
    if args.threads is not None:
        args.thread_choice = threads.explicit(args.threads, "--threads")
    else:
        args.thread_choice = threads.auto(getattr(args, "load_since", None))
    if args.thread_choice.clamped:
        print(f"mcsd-generate: note: threads {args.thread_choice.reason}; using {args.thread_choice.threads}",
              file=sys.stderr)
    torch.set_num_threads(args.thread_choice.threads)


def _settings(args, decoder, dtype_reason) -> dict:
    """What actually ran: a baseline run has no tree, policy or drafter."""
    drafter = decoder.drafter
    drafted = not args.baseline
    kind = None if drafter is None else ("feature" if getattr(drafter, "uses_target_hidden", False) else "model")
    if decoder.context is not None:
        kind = "context" if kind is None else f"{kind}+context"
    return {"tree": args.tree if drafted and drafter is not None else None,
            "policy": args.policy if drafted and drafter is not None else None,
            "drafter": kind if drafted else None,
            "dtype": args.dtype, "dtype_reason": dtype_reason, "weights": args.weights, "costs": decoder.costs_source,
            "matmul_kernels": decoder.kernels_note,
            "acceptance_model": getattr(decoder.policy, "model_source", None) if drafted else None,
            "device": args.device, "attention": decoder.attention, "baseline": args.baseline,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
            "min_p": args.min_p, "typical_p": args.typical_p, **_processing(args),
            "lossy_target_roots": args.lossy_target_roots,
            "threads": args.thread_choice.threads, "threads_reason": args.thread_choice.reason,
            "calibration_s": round(decoder.calibration_s + getattr(args, "dtype_calibration_s", 0.0), 2),
            "context": _context_settings(decoder) if drafted else None}


def _context_settings(decoder) -> dict | None:
    """The context drafter's sources and their measured acceptance, or None without one."""
    if decoder.context is None:
        return None
    from .drafting.context import describe
    return describe(decoder.context)


def parse_policy_options(items: list[str]) -> dict:
    """["h=0.4", "post_verify=false"] -> {"h": 0.4, "post_verify": False}: numbers and true/false are
    converted, anything else stays a string (a path, say). ConfigError on an item without "=". The policy
    itself checks names and ranges."""
    options = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise ConfigError(f"--policy-option takes NAME=VALUE, got {item!r}")
        low = value.strip().lower()
        if low in ("true", "false"):
            options[name.strip()] = low == "true"
            continue
        try:
            options[name.strip()] = int(value)
        except ValueError:
            try:
                options[name.strip()] = float(value)
            except ValueError:
                options[name.strip()] = value
    return options


def run(args) -> int:
    if args.list_models:
        print("\n".join(describe_presets()))
        return 0
    from .forward.threads import snapshot
    args.load_since = snapshot()                    # other processes' CPU use is read from here to the load
    from .drafting import pearl  # noqa: F401  (registers the "pearl" execution mode)
    from .drafting.policies import POLICIES, resolve_policy
    parse_policy_options(args.policy_option)        # a malformed setting fails before anything loads
    args.policy = resolve_policy(args.policy, lossy=args.lossy_target_roots > 0,
                                 drafting=not args.baseline and not _drafter_kinds(args)[2])
    if args.tree is None:
        args.tree = POLICIES[args.policy].default_tree if args.policy in POLICIES else "4,2,2"
    _check_args(args)                               # fail on a malformed flag before loading anything
    if args.prompts_file is not None:
        texts = _read_prompts_file(args.prompts_file)
    else:
        texts = [_read_prompt(args)]
    _check_hub(args)
    target, draft, tokenizer = _load_models(args)
    prompts = [_format_prompt(text, tokenizer, args) for text in texts]
    _check_lengths(args, target, tokenizer, prompts)  # before any calibration: a bad input costs nothing
    decoder, dtype_reason = _build_decoder(args, target, draft, tokenizer)
    if args.prompts_file is not None:
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
    except KeyboardInterrupt:                         # keep what was generated: the rest of the text
        text = tokenizer.decode(streamed, skip_special_tokens=True)
        if args.json:                                 # still one JSON object, marked as cut short
            sys.stdout.write(json.dumps({"text": text, "tokens": streamed, "finish_reason": "interrupted",
                                         "settings": _settings(args, decoder, dtype_reason)}) + "\n")
        else:
            sys.stdout.write(text[len(printed["text"]):] + "\n")
        sys.stdout.flush()
        print(f"mcsd-generate: interrupted after {len(streamed)} tokens", file=sys.stderr)
        return 130
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
        blocks = decoder.target.blocks
        if blocks is not None and blocks.capture:
            print(f"cuda graphs: {blocks.captures} captured in {blocks.capture_s:.2f}s", file=sys.stderr)
        elif blocks is not None and blocks.failure:
            print(f"cuda graphs: off, capture failed ({blocks.failure}); the same shapes ran eagerly",
                  file=sys.stderr)
        from .costs.forward_profile import resident_bytes
        from .costs.profile import drafter_module
        held = resident_bytes(decoder.target.model, drafter_module(decoder.drafter) if decoder.drafter else None)
        print("weights resident: " + ", ".join(f"{n / 1e6:.0f} MB {form}" for form, n in held.items() if n),
              file=sys.stderr)
        own = "the engine's own (Llama family)" if decoder.target.path == "lean" else "transformers'"
        print(f"forward: {own}", file=sys.stderr)
        from .forward.attention import describe as describe_attention
        print(f"attention: {describe_attention(decoder.attention)}; KV cache written in place", file=sys.stderr)
        if decoder.costs_source is not None:
            costs = getattr(decoder.policy, "costs", None) or decoder.context_costs
            online = ", corrected online" if getattr(costs, "online", False) else ", fixed for the run"
            stale = getattr(costs, "stale", None)
            stale = f"; stale, measured again at the next quiet start: {stale}" if stale else ""
            print(f"costs: {_COSTS_SOURCES[decoder.costs_source]}{online}{stale}", file=sys.stderr)
        if not args.baseline and getattr(decoder.policy, "model_source", None) is not None:
            print(f"acceptance model: {decoder.policy.model_source}", file=sys.stderr)
    if args.show_tree and rounds:
        _draw_best_round(rounds, args.show_tree, tokenizer)
    return 0


def _options(args) -> dict:
    """The generation keywords the flags ask for (unset ones left out)."""
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop_strings=tuple(args.stop), min_p=args.min_p,
                   typical_p=args.typical_p, **_processing(args))
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
    from .loading.progress import bars_wanted
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
    except KeyboardInterrupt:
        print(f"mcsd-generate: interrupted after {done} of {len(prompts)} prompts", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
        if sink is not sys.stdout:
            sink.close()
    if args.stats:
        print(f"{done} prompts", file=sys.stderr)
    return 0


def _draw_best_round(rounds, path: str, tokenizer) -> None:
    from .core.viz import draw_tree
    best = max(range(len(rounds)), key=lambda i: (rounds[i][1].n_accepted, -i))
    try:
        written = draw_tree(*rounds[best], path, tokenizer,
                            title=f"round {best + 1} of {len(rounds)}: {rounds[best][0].size - 1} draft nodes, "
                                  f"{rounds[best][1].n_accepted} accepted")
    except OSError as exc:
        raise UsageError(f"cannot write --show-tree {path}: {exc.strerror or exc}") from None
    print(f"tree drawn to {written}", file=sys.stderr)


# Flags whose value may itself start with "-" (a prompt, a stop string, a malformed tree): argparse
# would take "--tree -1,2" for two flags and say "expected one argument", not what is wrong.
FREE_VALUE_FLAGS = ("--prompt", "--system", "--stop", "--tree")


def _join_free_values(argv: list[str]) -> list[str]:
    """"--tree -1,2" -> "--tree=-1,2" for the flags in FREE_VALUE_FLAGS, so the value reaches its check."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in FREE_VALUE_FLAGS and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(_join_free_values(list(sys.argv[1:] if argv is None else argv)))
    except SystemExit as exc:                        # argparse already printed the problem (or the help)
        return int(exc.code or 0)
    try:
        return run(args)
    except (UsageError, ConfigError, ModelLoadError) as exc:
        print(f"mcsd-generate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                        # before any text: still one JSON object with --json
        if args.json:
            print(json.dumps({"text": "", "tokens": [], "finish_reason": "interrupted"}))
        return 130


def entry() -> None:
    """The `mcsd-generate` command: `main()` in a process of its own, set up for a quick start and exit.

    - No progress bars when stderr is not a terminal (see `mcsd.loading.progress`).
    - Start-up (importing torch and transformers, loading the models) makes
      hundreds of thousands of objects that live until exit; the default
      collector walks them again and again while they are made (about 0.6 s of
      a short run on a 2-core CPU), so it runs less often here. It still runs,
      so a long generation keeps its memory in check.
    - At exit they are frozen, so the interpreter's final collection skips them
      (another ~0.8 s); the operating system reclaims the memory anyway.
    """
    from .loading.progress import no_bars_off_terminal
    no_bars_off_terminal()
    gc.set_threshold(50_000, 20, 100)
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
