"""Target-generated training data for draft models.

The command-line front end of `mcsd.train.engine`; `--help` lists the options.
"""

from mcsd.train.engine import main

if __name__ == "__main__":
    raise SystemExit(main())
