"""Arrival schedules, as ``vllm bench serve`` draws them (vllm/benchmarks/serve.py ``get_request``, 0.32.0)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from loadtest.schedule import Schedule, arrival_offsets, check, offered_rate, used_burstiness


def test_burst_sends_everything_at_zero():
    assert arrival_offsets(Schedule.burst, 5) == [0.0] * 5


def test_constant_rate_spacing():
    # vLLM's burstiness=inf: every gap is 1/rate, the first one included
    assert arrival_offsets(Schedule.constant, 4, rate=2.0) == [0.5, 1.0, 1.5, 2.0]


@pytest.mark.parametrize("schedule, burstiness", [(Schedule.poisson, 1.0), (Schedule.gamma, 0.5), (Schedule.gamma, 4.0)])
def test_gamma_arrivals_have_the_asked_rate(schedule, burstiness):
    offsets = arrival_offsets(schedule, 20000, rate=50.0, burstiness=burstiness, seed=1)
    assert offsets[0] > 0 and all(b >= a for a, b in itertools.pairwise(offsets))
    gaps = np.diff(offsets)
    assert 20000 / offsets[-1] == pytest.approx(50.0, rel=0.05)
    # coefficient of variation of gamma gaps is 1/sqrt(shape): burstier means more spread
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)
    assert offsets == arrival_offsets(schedule, 20000, rate=50.0, burstiness=burstiness, seed=1)


def test_rate_schedules_need_a_rate():
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(Schedule.poisson, 3)




@pytest.mark.parametrize("schedule, burstiness", [(Schedule.poisson, 1.0), (Schedule.gamma, 0.3), (Schedule.gamma, 3.0)])
def test_every_seed_offers_exactly_the_asked_rate(schedule, burstiness):
    # vLLM rescales the summed gaps so the last request is due at n/rate: no seed offers 0.85x or 1.24x
    for seed in range(20):
        offsets = arrival_offsets(schedule, 100, rate=10.0, burstiness=burstiness, seed=seed)
        assert offsets[-1] == pytest.approx(10.0) and offered_rate(offsets) == pytest.approx(10.0)


def test_settings_a_schedule_would_ignore_are_refused():
    with pytest.raises(ValueError, match="burstiness"):
        check(Schedule.poisson, 5.0, 0.5)  # poisson is gamma with burstiness 1
    with pytest.raises(ValueError, match="--rate"):
        check(Schedule.burst, 5.0, 1.0)
    with pytest.raises(ValueError, match="positive"):
        check(Schedule.gamma, 5.0, 0.0)
    check(Schedule.gamma, 5.0, 0.5)


def test_the_burstiness_used_is_what_is_recorded():
    assert used_burstiness(Schedule.poisson, 1.0) == 1.0
    assert used_burstiness(Schedule.gamma, 0.5) == 0.5
    assert used_burstiness(Schedule.constant, 1.0) == float("inf")
    assert offered_rate(arrival_offsets(Schedule.burst, 3)) is None
