"""The round: `TreeDecoder` and its loop, the parts it resolves, its calibrated costs, the default dtype."""
