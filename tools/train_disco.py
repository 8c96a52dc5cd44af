"""Fit DISCO's continue-or-stop classifier on fitting-split traces and pick its threshold for speed.

The command-line front end of `mcsd.train.disco`; `--help` lists the options.
"""

from mcsd.train.disco import main

if __name__ == "__main__":
    raise SystemExit(main())
