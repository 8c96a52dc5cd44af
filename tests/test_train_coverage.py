"""Sub-vocabulary coverage of the target's argmax (mcsd.train.coverage)."""

import pytest

from mcsd.train import coverage
from mcsd.train.shards import Record


def _records(n_prompts=200):
    # prompt i answers with tokens i % 7 (common) and 100 + i (rare: seen once, never again)
    return [Record(f"p{i}/0", "open", [1, 2], [i % 7, i % 7, 100 + i], True) for i in range(n_prompts)]


def test_the_split_keeps_a_prompts_responses_together_and_is_stable():
    recs = _records() + [Record(f"p{i}/1", "open", [1], [5], True) for i in range(200)]
    fit, out = coverage.split_records(recs)
    assert {r.prompt_id for r in fit}.isdisjoint({r.prompt_id for r in out})
    assert 20 < len({r.prompt_id for r in out}) < 70                    # about one prompt in five
    assert coverage.split_records(recs) == (fit, out)


def test_frequency_ranking_and_coverage_curve():
    ranked = coverage.frequency_ranked([[3, 3, 3, 9, 9, 1], [9, 1, 4]])
    assert ranked == [3, 9, 1, 4]                                        # ties (none here) broken by id
    assert coverage.frequency_ranked([[2, 1]]) == [1, 2]
    curve = coverage.coverage_curve(ranked, [3, 3, 9, 7], sizes=(1, 2, 8))
    assert [p["coverage"] for p in curve] == [0.5, 0.75, 0.75]          # 7 was never seen: never covered
    assert curve[-1]["ids"] == 4
    assert coverage.smallest_size(curve, 0.7) == 2 and coverage.smallest_size(curve, 0.9) is None


def test_report_measures_held_out_prompts_only():
    result = coverage.report(_records(), head_vocab_ids=list(range(7)), sizes=(7, 1000))
    # the rare tokens of held-out prompts never occur in the fitting ones: a third stays uncovered
    assert result["curve"][0]["coverage"] == pytest.approx(2 / 3, abs=1e-4)
    assert result["curve"][1]["coverage"] == pytest.approx(2 / 3, abs=1e-4)
    assert result["head"] == {"size": 7, "coverage": pytest.approx(2 / 3, abs=1e-4)}
    assert result["heldout_tokens"] == 3 * result["heldout_prompts"]


def test_report_needs_both_sides():
    with pytest.raises(ValueError, match="both sides"):
        coverage.report(_records(1)[:0])
