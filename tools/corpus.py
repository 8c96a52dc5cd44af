"""Text for teacher-forced passes, cut into token chunks with provenance.

The code is `mcsd.train.corpus`; `python tools/target_data.py corpus` runs it.
"""

from mcsd.train.corpus import main

if __name__ == "__main__":
    raise SystemExit(main())
