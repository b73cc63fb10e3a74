"""Copies between the host and the device that never wait for the work queued on the device.

With async scheduling the host prepares step N+1 while the GPU runs step N. A plain
``torch.tensor(values, device="cuda")`` or ``tensor.tolist()`` synchronises the whole stream first, so the
host would wait for step N (or even N+1) to finish at every one of them: inputs go through ``to_device``,
and a step's picked tokens come back through ``PendingPicks``, which waits for that step alone.
"""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without waiting for the work already queued there (the
    driver stages the host memory at once)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class PendingPicks:
    """A step's picked token ids on their way to the host: copied into pinned memory right behind the step that
    made them, so that waiting for them (``tolist``) does not also wait for the steps launched since, as a
    plain copy, queued behind those on the same stream, would. ``device`` keeps them where the next step's
    placeholders read them."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.device = tokens
        self._ready = None
        self._host = tokens
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tokens.device))  # the copy's stream: the engine's GPU need not be current

    def tolist(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
