"""Train a target-feature draft head (mcsd.drafting.feature_draft.FeatureHead) on target-written data.

The command-line front end of `mcsd.train.feature_head`; `--help` lists the options.
"""

from mcsd.train.feature_head import main

if __name__ == "__main__":
    raise SystemExit(main())
