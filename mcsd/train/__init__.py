"""The training library: target-written data, distillation, feature-head and
decision-model training.

`tools/*.py` are the command-line front ends over it. The runtime package
(`mcsd` outside this folder) never imports `mcsd.train`, so an inference user
pays nothing for it.
"""


def portable(value):
    """A card's value with machine-local paths made portable: the repository's root becomes a
    relative path and the home folder `~`, in every string of nested dicts and lists (a card is
    read on other machines, and must not name this one's folders)."""
    from pathlib import Path

    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    if not isinstance(value, str):
        return value
    root, home = str(Path(__file__).resolve().parents[2]), str(Path.home())
    if value in (root, home):
        return "." if value == root else "~"
    return value.replace(root + "/", "").replace(home + "/", "~/")


def library_main(doc: str, runs_it: str, argv: list[str] | None = None) -> int:
    """The command line of a library module with no stage of its own: `--help` (or no argument) prints
    its docstring and what runs it.

    Args:
        doc: the module's docstring.
        runs_it: one sentence naming the commands that use the module.
        argv: command-line arguments (default: sys.argv[1:]).
    Returns:
        0, the exit status.
    """
    import argparse

    parser = argparse.ArgumentParser(description=doc, epilog=runs_it,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    parser.print_help()
    return 0
