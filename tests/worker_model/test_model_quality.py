"""The quality report's statistics: the matched count, the agreement's Wilson interval and the reference's near
ties (worker.model.quality), which bench/quant.py prints beside each variant's agreement."""

from __future__ import annotations

import math

import pytest
import torch
from worker.model.quality import QualityReport, Reference, near_ties


@pytest.mark.parametrize(
    ("matches", "positions", "lo", "hi"),
    [
        (182, 192, 0.9068, 0.9715),  # SmolLM2's fp8 in bench/quant.py: 0.95 is inside, so is 0.97
        (96, 192, 0.4300, 0.5700),  # symmetric about a half
        (192, 192, 0.9804, 1.0),  # all matched: the interval reaches 1 and is not empty
        (0, 192, 0.0, 0.0196),
        (19, 20, 0.7639, 0.9911),  # few positions: wide
        (1900, 2000, 0.9396, 0.9587),  # many: narrow
    ],
)
def test_agreement_interval_is_the_wilson_score_interval(matches, positions, lo, hi):
    # (the bounds: the roots of (p - x)^2 = z^2 x (1 - x) / n, z = 1.96, solved apart from the code under test)
    report = QualityReport(agreement=matches / positions, mean_kl=0.0, positions=positions)
    assert report.matches == matches
    got = report.agreement_interval()
    assert got == pytest.approx((lo, hi), abs=1e-4)
    assert got[0] <= report.agreement <= got[1]


def test_agreement_interval_narrows_with_positions_and_widens_with_z():
    widths = []
    for n in (24, 192, 1536):
        lo, hi = QualityReport(agreement=0.75, mean_kl=0.0, positions=n).agreement_interval()
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2]
    report = QualityReport(agreement=0.75, mean_kl=0.0, positions=192)
    (lo95, hi95), (lo99, hi99) = report.agreement_interval(), report.agreement_interval(z=2.576)
    assert lo99 < lo95 and hi99 > hi95


def test_no_positions_tell_nothing():
    assert QualityReport(agreement=0.0, mean_kl=0.0, positions=0).agreement_interval() == (0.0, 1.0)


def _reference(rows: list[list[float]]) -> Reference:
    """A one-sequence reference whose positions' log-probabilities are log-softmaxes of the given logits."""
    logprobs = torch.log_softmax(torch.tensor(rows), -1)
    return Reference(sequences=[[0] * (len(rows) + 1)], starts=[0], logprobs=[logprobs])


def test_near_ties_count_positions_whose_top_two_are_close():
    ref = _reference(
        [
            [2.0, 1.95, -1.0],  # 0.05 apart: a tie at 0.1 and at 0.5
            [0.0, 3.0, 2.7],  # 0.3 apart (the top two are not the first two): a tie at 0.5 only
            [5.0, 0.0, 0.0],  # 5 apart: never
            [1.0, 1.0, 1.0],  # exactly tied
        ]
    )
    assert [near_ties(ref, nats) for nats in (0.0, 0.1, 0.5, 10.0)] == [0, 2, 3, 4]
    assert math.isclose(float(ref.logprobs[0][1].max() - ref.logprobs[0][1][2]), 0.3, abs_tol=1e-6)
