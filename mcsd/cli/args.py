"""`mcsd-generate`'s flags and their checks: everything that can be found wrong before a model loads.

`add_model_arguments` (the model, dtype, drafter and policy flags) is shared with `mcsd-serve`.
"""


from __future__ import annotations

import argparse
from pathlib import Path

from ..config import (
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
from ..loading.presets import DEFAULT_PRESET, DRAFTERS, PRESETS, parse_drafter_spec
from ..loading.sources import is_local_path_syntax

DRAFTER_CHOICES = (*DRAFTERS, "context", *(f"{d}+context" for d in DRAFTERS))


class Parser(argparse.ArgumentParser):
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
                          "outputs (built by tools/build_context_store.py; safetensors, never unpickled). "
                          "Default: none (the prompt, the output so far and the target's recycled predictions)")
    src.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_NAMES),
                     help="compute dtype (default auto: the one this pair and method run fastest in on this "
                          "machine, from its calibrated costs)")
    src.add_argument("--weights", default="auto", choices=("auto", *WEIGHTS),
                     help="q4: run the target's linear layers on the 4-bit codes of the Q4_1 GGUF it comes from "
                          "(the embedded preset's, or a .gguf target), as llama.cpp does; CPU only, in float32 or "
                          "bfloat16 as the kernel and CPU suit (--stats says), exact with respect to q4 decoding. "
                          "q4q8: q4 weights on 8-bit activations, llama.cpp's arithmetic: each row rounded to 8 "
                          "bits a block of 32, integer dot products (AMX tiles, VNNI or AVX2, the same bits; "
                          "native kernel, float32); a slightly different target, exact with respect to q4q8 "
                          "decoding. "
                          "dense: the dequantised weights. Default auto: "
                          "with --dtype auto, whichever the calibrated costs say runs fastest here (dense "
                          "for a target that is no GGUF, or with another --dtype)")
    src.add_argument("--device", default="cpu",
                     help="cpu, cuda, cuda:N, or auto (spread the target over GPUs); default cpu")
    src.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                     help=f"tree attention backend: {', '.join(ATTENTION_BACKENDS)} (default auto: xformers on CUDA "
                          f"where it runs, gqa on a CPU, else sdpa)")
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
                          "else static; static for a feature head on CUDA, whose fixed-shape round replays a "
                          "static tree as CUDA graphs)")
    dec.add_argument("--policy-option", action="append", default=[], metavar="NAME=VALUE",
                     help="a policy setting, e.g. h=0.4 (svip), threshold=0.1 (disco, specdecpp), "
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
    p = Parser(
        prog="mcsd-generate",
        description="Generate text with lossless multi-candidate tree speculative decoding. "
                    f"Without --target/--draft the embedded pair {DEFAULT_PRESET!r} is used.")
    src, _ = add_model_arguments(p)
    from .. import __version__
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    src.add_argument("--list-models", action="store_true", help="list the built-in presets and their drafters, "
                                                                "and exit")

    inp = p.add_argument_group("prompt")
    inp.add_argument("--prompt", help="prompt text (default: read --prompt-file, else stdin); UTF-8")
    inp.add_argument("--prompt-file", help="read the prompt from this file (UTF-8)")
    inp.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the chat template")
    inp.add_argument("--system", help="system message for --chat (default: none, or the "
                                       "chat template's own where it has one)")
    inp.add_argument("--prompts-file", metavar="FILE.jsonl",
                     help="several prompts, one JSON object a line with a \"prompt\" or \"text\" field (or "
                          "Spec-Bench rows: the first of \"turns\"); generated one after another, one JSON result "
                          "a line to stdout or --output")

    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="new tokens at most (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off (default)")
    gen.add_argument("--seed", type=int, default=None,
                     help="sampling: the same seed gives the same text, whatever the trees (default: a fresh one "
                          "each run)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop string (repeatable; default: none, the target's EOS ends the text)")
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
    out.add_argument("--stream", action="store_true", help="print text as it is accepted (not with --json)")
    out.add_argument("--stats", action="store_true", help="print tokens/s, tau and acceptance by depth to stderr")
    out.add_argument("--json", action="store_true", help="print one JSON object with text, tokens and stats")
    out.add_argument("--logprobs", action="store_true",
                     help="with --json or --prompts-file: the target's log-probability of each new token")
    out.add_argument("--output", metavar="FILE.jsonl", help="with --prompts-file: write the results here")
    out.add_argument("--show-tree", metavar="FILE.png",
                     help="draw the round with the longest accepted path (needs matplotlib; default: no drawing)")
    return p


class UsageError(Exception):
    pass


def check_sources(args) -> None:
    """A model given as a path that does not exist is named as such, before anything else about it."""
    for flag, source in (("--target", args.target), ("--draft", args.draft)):
        if source is not None and source not in PRESETS and is_local_path_syntax(source) \
                and not Path(source).expanduser().exists():
            raise UsageError(f"{flag} {source}: model path does not exist")


def _hub_ids(args) -> list[tuple[str, str]]:
    """(flag, id) for each model source that can only be a Hugging Face Hub id."""
    from ..loading.sources import is_hub_id
    return [(flag, src) for flag, src in (("--target", args.target), ("--draft", args.draft))
            if src is not None and is_hub_id(src)]


def check_hub(args) -> None:
    """Hub ids without a network: load from the local cache in offline mode (no retries), or stop at once
    with one line when a model is not cached (`mcsd.loading.sources.prepare_hub`)."""
    from ..loading.sources import prepare_hub
    prepare_hub(_hub_ids(args))


def check_args(args) -> None:
    """Every mistake that needs no model, found before anything is loaded."""
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_sources(args)
    if args.lossy_target_roots < 0:
        raise UsageError(f"--lossy-target-roots must be >= 0, got {args.lossy_target_roots}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.weights in ("q4", "q4q8") and args.device != "cpu":
        raise UsageError(f"--weights {args.weights} runs on the CPU; drop --device {args.device}")
    from ..loading.sources import check_source
    if args.draft is not None and not args.baseline:
        check_source(args.draft, "--draft")          # a bad draft file is named by its flag, before loading
    if (args.target is not None and args.draft is None and args.target not in PRESETS and not args.baseline
            and args.drafter != "context"):
        check_source(args.target, "--target")         # what is wrong with the target comes first
        raise UsageError(f"--target {args.target} needs a --draft (or use --baseline, --drafter context, or a "
                         f"preset: {', '.join(PRESETS)})")
    if args.draft is not None and args.target is None:
        raise UsageError(f"--draft needs --target: a draft is checked against the target whose tokenizer it "
                         f"shares; name that target (a preset works: --target {DEFAULT_PRESET} --draft DIR)")
    if args.logprobs and not (args.json or args.prompts_file is not None):
        raise UsageError("--logprobs is printed in the JSON result: add --json (or use --prompts-file)")
    if args.stream and args.json:
        raise UsageError("--stream prints the text as it comes, --json one object at the end; pass one of them")
    if args.stream and args.prompts_file is not None:
        raise UsageError("--stream prints one prompt's text as it comes; --prompts-file writes JSON results")
    check_policy(args)
    if args.device != "cpu" and args.device != "auto":
        check_device(args.device)
    if args.attention == "xformers" and args.device == "cpu":
        raise UsageError("--attention xformers runs on CUDA devices only; on a CPU use --attention auto, gqa, sdpa "
                         "or eager (or pass --device cuda)")
    if args.output is not None and args.prompts_file is None:
        raise UsageError("--output writes --prompts-file results; for one prompt, redirect stdout")
    if args.output is not None:
        check_writable(args.output, "--output")
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("--prompt and --prompt-file both give the prompt; pass one of them")
    if args.prompts_file is not None and (args.prompt is not None or args.prompt_file is not None):
        raise UsageError("--prompts-file takes the prompts from the file; drop --prompt / --prompt-file")
    if args.system is not None and not args.chat:
        raise UsageError("--system is a turn of the chat template: add --chat (without it the prompt goes to the "
                         "target as plain text)")
    if args.tree is not None and not args.tree.strip():
        raise UsageError("--tree is empty: give a k-config such as 4,2,2, or 0 for no drafting")
    if args.prompts_file is not None and args.show_tree:
        raise UsageError("--show-tree draws one generation; it does not combine with --prompts-file")
    model_kind, with_context, context_only = drafter_kinds(args)
    if args.context_store is not None:
        if not with_context:
            raise UsageError("--context-store needs a context drafter (--drafter context, feature+context or "
                             "model+context)")
        store = Path(args.context_store).expanduser()
        if not store.is_file():
            raise UsageError(f"--context-store {args.context_store}: no such file")
        from ..drafting.context import ContextStore
        try:
            ContextStore.check_file(store)
        except ConfigError as exc:
            raise UsageError(f"--context-store: {exc}") from None
    if with_context and args.lossy_target_roots:
        raise UsageError("--drafter with context is exact-only; it cannot be combined with --lossy-target-roots")
    if with_context and args.policy == "pearl":
        raise UsageError("--policy pearl drafts a chain with a draft model; it cannot take a context drafter")
    if args.policy == "pearl" and not args.baseline:
        check_pearl_drafter(args, model_kind)
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
    from ..core.tree import parse_tree_spec
    options = {k: v for k, v in processing(args).items() if v is not None}
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, seed=args.seed, stop_strings=tuple(args.stop),
                          sampling=SamplingConfig(args.temperature, args.top_k, args.top_p, args.min_p or 0.0,
                                                  1.0 if args.typical_p is None else args.typical_p),
                          processing=ProcessingConfig(**options))
    if not args.baseline:
        check_lossy_roots(args.lossy_target_roots, decode.sampling)
    parse_tree_spec(args.tree)
    if (args.lossy_target_roots or args.policy == "pearl") and not args.baseline \
            and (options or args.logprobs):
        raise UsageError("--repetition-penalty, --no-repeat-ngram-size, --min-new-tokens and --logprobs need the "
                         "exact tree loop; not with --lossy-target-roots or --policy pearl")


def check_pearl_drafter(args, model_kind: str | None) -> None:
    """The pearl mode runs a standalone draft model ahead of verification: a drafter reading the target's
    features (the feature head, an EAGLE-3 head, a preset's default) is refused before anything loads."""
    if args.draft is not None:
        draft = Path(args.draft).expanduser()
        from ..drafting.eagle3 import eagle3_layout
        from ..drafting.feature_draft import is_feature_head
        if is_feature_head(draft) or eagle3_layout(draft) is not None:
            raise UsageError(f"--policy pearl runs a standalone draft model next to the target; --draft {args.draft} "
                             f"is a head that reads the target's features: give a draft LM")
        return
    target = args.target or DEFAULT_PRESET
    from ..loading.models import preset_default_drafter
    kind = model_kind or (preset_default_drafter(PRESETS[target]) if target in PRESETS else None)
    if kind == "feature":
        named = "--drafter feature" if model_kind else f"{target}'s default drafter (feature)"
        raise UsageError(f"--policy pearl runs a standalone draft model next to the target; {named} reads the "
                         f"target's features: add --drafter model")


def check_window(args) -> None:
    """--max-new-tokens within the target's context window, where its config is read without its weights
    (`mcsd.loading.sources.context_window`: a preset's, a directory's, a GGUF's, a cached hub id's); the
    prompt's own tokens are counted once the tokenizer has loaded."""
    from ..loading.sources import context_window
    window = context_window(args.target or DEFAULT_PRESET)
    if window is not None and args.max_new_tokens >= window:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} plus the prompt exceeds the target's context "
                         f"window of {window} tokens")


def check_policy(args) -> None:
    """--policy names a policy and each --policy-option one of its settings with a value it takes: the
    policy is made once here, over its own default tree, and its own checks run (a few milliseconds;
    a policy's trained classifier or head, where it reads one, is read here too)."""
    from ..drafting.policies import POLICIES, make_policy
    if args.policy == "auto":
        return                                        # resolved to an installed policy when the run starts
    if args.policy not in POLICIES:
        raise UsageError(f"unknown policy {args.policy!r} (--policy); choose auto or one of "
                         f"{', '.join(sorted(POLICIES))}")
    options = parse_policy_options(args.policy_option)
    if options:
        import inspect
        known = [n for n in inspect.signature(POLICIES[args.policy].__init__).parameters
                 if n not in ("self", "topology")]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise UsageError(f"--policy-option {unknown[0]}: policy {args.policy!r} has no such setting; its "
                             f"settings: {', '.join(known) or 'none'}")
        try:
            make_policy(args.policy, None, **options)
        except (ConfigError, ValueError, TypeError) as exc:
            raise UsageError(f"--policy-option: {exc}") from None


def check_device(device: str) -> None:
    """A CUDA device that this machine has (torch is imported for it, still before any model loads)."""
    import torch
    if not str(device).startswith("cuda"):
        raise UsageError(f"unknown device {device!r} (--device); choose cpu, cuda, cuda:N or auto")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {device}: torch finds no CUDA device here; use --device cpu")
    index = str(device).partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_writable(path: str, flag: str) -> None:
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


# Flags whose value may itself start with "-" (a prompt, a stop string, a malformed tree): argparse
# would take "--tree -1,2" for two flags and say "expected one argument", not what is wrong.
FREE_VALUE_FLAGS = ("--prompt", "--system", "--stop", "--tree")


def join_free_values(argv: list[str]) -> list[str]:
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


def processing(args) -> dict:
    return {"repetition_penalty": args.repetition_penalty, "no_repeat_ngram_size": args.no_repeat_ngram_size,
            "min_new_tokens": args.min_new_tokens}


def drafts_nothing(args) -> bool:
    """--tree 0 (or an empty spec, refused by check_args): plain target steps, nothing drafted."""
    return args.tree is not None and args.tree.strip() in ("", "0")


def settle_policy(args, drafting: bool) -> None:
    """--policy auto resolved (`resolve_policy`) and --tree's default set from it, before anything loads:
    "static" for a feature head on CUDA, which runs the fixed-shape round, else "learned" where the run
    drafts exactly with its acceptance model installed."""
    from ..decoding import fixed_round
    from ..drafting.policies import POLICIES, resolve_policy
    kind = drafter_kinds(args)[0]
    if kind is None and args.draft is None:
        kind = PRESETS[args.target or DEFAULT_PRESET].default_drafter if (args.target or DEFAULT_PRESET) in PRESETS \
            else None
    # --device auto spreads the model over CUDA devices (loading refuses it without one)
    fixed = kind == "feature" and fixed_round.default_on("cuda" if args.device == "auto" else args.device)
    args.policy = resolve_policy(args.policy, lossy=args.lossy_target_roots > 0, drafting=drafting, fixed_round=fixed)
    if args.tree is None:
        args.tree = POLICIES[args.policy].default_tree if args.policy in POLICIES else "4,2,2"


def drafter_kinds(args) -> tuple[str | None, bool, bool]:
    """(the model drafter's kind, None for the preset's default or none; whether context drafting is
    on; whether it is context alone). Without --drafter: the preset's (or --draft's) drafter with
    context merged in, except where context cannot join (--lossy-target-roots, the pearl mode) or
    nothing is to be drafted (--tree 0)."""
    if args.drafter is None:
        return None, not (args.lossy_target_roots or args.policy == "pearl" or drafts_nothing(args)), False
    kind, context = parse_drafter_spec(args.drafter)
    return kind, context, kind is None
