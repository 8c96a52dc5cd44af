"""Fit the acceptance models tree policies use, compare them on held-out traces, ship the best.

The command-line front end of `mcsd.train.decision_models`; `--help` lists the options.
"""

from mcsd.train.decision_models import main

if __name__ == "__main__":
    raise SystemExit(main())
