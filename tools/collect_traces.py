"""Record, for every drafted node, its features and whether the target accepted it: training data for tree policies.

The command-line front end of `mcsd.train.traces`; `--help` lists the options.
"""

from mcsd.train.traces import main

if __name__ == "__main__":
    raise SystemExit(main())
