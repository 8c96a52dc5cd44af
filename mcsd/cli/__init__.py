"""`mcsd-generate`: command-line front end. Flags map onto the library's arguments, nothing else.

User mistakes (bad flags, malformed or oversized tree, missing model, mismatched
tokenizers, prompts past the context window, undecodable prompt bytes, a cache
that cannot be written, ...) print one clear line and exit with 2.

Start-up: nothing heavy is imported at module level (torch and transformers
load only when a model does), so `--list-models`, `--help` and argument
mistakes answer at once.
"""

from __future__ import annotations

import gc
import json
import signal
import sys

from ..config import ConfigError
from ..errors import ModelLoadError
from .args import UsageError, build_parser, join_free_values
from .generate import Terminated, run


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(join_free_values(list(sys.argv[1:] if argv is None else argv)))
    except SystemExit as exc:                        # argparse already printed the problem (or the help)
        return int(exc.code or 0)
    try:
        return run(args)
    except (UsageError, ConfigError, ModelLoadError) as exc:
        print(f"mcsd-generate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:                # before any text: still one JSON object with --json
        if args.json:
            print(json.dumps({"text": "", "tokens": [], "finish_reason": "interrupted"}))
        return getattr(stop, "exit_code", 130)


def _terminated(signum, frame):
    raise Terminated()


def entry() -> None:
    """The `mcsd-generate` command: `main()` in a process of its own, set up for a quick start and exit.

    - No progress bars when stderr is not a terminal (see `mcsd.loading.progress`).
    - SIGTERM stops it as Ctrl-C does: the text so far is printed (exit 143, 130 for Ctrl-C).
    - Start-up (importing torch and transformers, loading the models) makes
      hundreds of thousands of objects that live until exit; the default
      collector walks them again and again while they are made (about 0.6 s of
      a short run on a 2-core CPU), so it runs less often here. It still runs,
      so a long generation keeps its memory in check.
    - At exit they are frozen, so the interpreter's final collection skips them
      (another ~0.8 s); the operating system reclaims the memory anyway.
    """
    from ..loading.progress import no_bars_off_terminal
    no_bars_off_terminal()
    signal.signal(signal.SIGTERM, _terminated)
    gc.set_threshold(50_000, 20, 100)
    code = main()
    gc.freeze()
    sys.exit(code)

