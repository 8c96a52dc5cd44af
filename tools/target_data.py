"""Target-generated training data for draft models.

The command-line front end of `mcsd.train.engine`; `--help` lists the options. Its stages run for hours
with their output in a log: progress bars are drawn only when stderr is a terminal.
"""

from mcsd.loading.progress import no_bars_off_terminal

no_bars_off_terminal()              # before tqdm is imported: it reads the switch then

from mcsd.train.engine import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
