"""Profiles whose step times are known by construction, for tests."""

from __future__ import annotations

from pathlib import Path

from backends.sim.profile import ProfileSource, StepProfile


def constant_step_profile(folder: Path, seconds: float = 0.1, step_spread: list[float] | None = None) -> Path:
    """A device on which every step is modelled to take ``seconds``, whatever it computes (peaks too high to
    matter), with ``step_spread`` around it if given."""
    profile = StepProfile(name="constant", device=f"every step {seconds} s", memory_bytes=80 << 30, peak_flops=1e30,
                          bandwidth=1e30, compute_efficiency=1.0, memory_efficiency=1.0, step_overhead_s=seconds,
                          per_sequence_s=0.0, step_spread=step_spread, source=ProfileSource(how="constructed for tests"))
    path = folder / "constant.json"
    profile.save(path)
    return path
