"""A drafter's chain acceptance by temperature (`mcsd.train.depth_report.chain_acceptance`), the figure a
head's card reports for greedy and sampled decoding."""

import copy

from mcsd.train.depth_report import chain_acceptance

SETTINGS = ((0.0, 1.0), (0.7, 0.95), (1.0, 1.0))


def test_a_draft_equal_to_the_target_is_accepted_at_every_depth_and_temperature(target):
    """The shared-noise verify makes sampling a question of distributions: a draft with the target's
    distribution draws the target's own token at every temperature."""
    rows = chain_acceptance(target, copy.deepcopy(target), [[1, 2, 3], [4, 5, 6, 7]], SETTINGS, seeds=(0, 1),
                            max_new_tokens=12)
    assert [(r["temperature"], r["generations"]) for r in rows] == [(0.0, 2), (0.7, 4), (1.0, 4)]
    for row in rows:
        assert row["reached"][0] > 0
        assert all(a == 1.0 for a in row["acceptance"] if a is not None), row
        assert row["tau"] > 2.0


def test_a_random_draft_is_accepted_less_often(target, random_draft):
    rows = chain_acceptance(target, random_draft, [[1, 2, 3], [4, 5, 6, 7]], SETTINGS, seeds=(0, 1),
                            max_new_tokens=12)
    for row in rows:
        assert row["acceptance"][0] < 1.0, row
        # depth 2 is offered only where depth 1 was accepted (less near the end of a generation)
        assert row["reached"][1] <= round(row["acceptance"][0] * row["reached"][0])
