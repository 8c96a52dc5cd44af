"""The training library: target-written data, distillation, feature-head and
decision-model training.

`tools/*.py` are the command-line front ends over it. The runtime package
(`mcsd` outside this folder) never imports `mcsd.train`, so an inference user
pays nothing for it.
"""
