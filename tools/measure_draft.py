"""Measure a draft model against its target and write the figures on its card.

The command-line front end of `mcsd.train.measure`; `--help` lists the options.
"""

from mcsd.train.measure import main

if __name__ == "__main__":
    raise SystemExit(main())
