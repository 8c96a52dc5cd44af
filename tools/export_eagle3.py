"""Write an EAGLE-3 head in the speculators layout (vllm serve) or the original one (SGLang, EAGLE).

The command-line front end of `mcsd.train.eagle3_export`; `--help` lists the options.
"""

from mcsd.train.eagle3_export import main

if __name__ == "__main__":
    raise SystemExit(main())
