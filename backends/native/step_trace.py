"""Each step's batch and how long it took while the engine serves: the data a simulator profile is fitted on
when the steps timed in-process leave out what serving adds (the HTTP server and the gateway sharing the host,
streaming, a step's host work beside the device's), so that ``burstgate sim fit --from TRACE`` fits on the
steps the engine really ran.

A trace is JSON lines: a header (the model's shape, dtype, block size, how steps run, this CPU's peaks), then one
``[query_lens, context_lens, sampled_rows, seconds]`` per step, the same as the steps ``sim fit --native
--save-steps`` writes. A step's seconds are its share of the engine's time line: from its start to the next
step's start while the engine has work (the host's bookkeeping between steps included); with async scheduling,
where a step's batch is launched in one call and finished in the next, from the end of the call that launched
it to the end of the call that finished it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from backends.native.batch import Batch

FLUSH_EVERY = 64  # steps buffered before a write: the engine thread writes rarely, a reader sees recent steps


@dataclass
class _Launched:
    work: list  # [query_lens, context_lens, sampled rows]
    start: float
    end: float
    overlapped: bool  # launched by an async step: finished by the next call


class StepTrace:
    """Appends the engine's steps to a trace file (JSON lines)."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        try:
            self._file: IO[str] = open(path, "w")  # noqa: SIM115 - open for the engine's life, closed by close()
        except OSError as exc:
            raise ValueError(f"step_trace: cannot write {str(path)!r}: {exc.strerror}") from None
        self._file.write(json.dumps({"what": "native engine steps timed while served, for `burstgate sim fit "
                                             "--from`", **header}) + "\n")
        self._file.flush()
        self._lines: list[str] = []
        self._pending: _Launched | None = None

    def step(self, batch: Batch | None, start: float, end: float, overlapped: bool, more: bool) -> None:
        """One call of the engine's ``step()`` from ``start`` to ``end``, which launched ``batch`` (None: none),
        ``overlapped`` if asynchronously; ``more``: whether the engine has work left after it."""
        if (pending := self._pending) is not None:
            self._pending = None
            self._write(pending.work, (end - pending.end) if pending.overlapped else (start - pending.start))
        if batch is not None:
            launched = _Launched([list(batch.query_lens), list(batch.context_lens), sum(batch.sample)], start, end,
                                 overlapped)
            if overlapped or more:  # its time ends with the next call
                self._pending = launched
            else:  # the engine goes idle: the step's own call is its time
                self._write(launched.work, end - start)
        if not more or len(self._lines) >= FLUSH_EVERY:
            self.flush()

    def _write(self, work: list, seconds: float) -> None:
        self._lines.append(json.dumps([*work, seconds]) + "\n")

    def flush(self) -> None:
        if self._lines:
            self._file.writelines(self._lines)
            self._file.flush()
            self._lines.clear()

    def close(self) -> None:
        self.flush()
        self._file.close()


def open_trace(path: str | Path, engine) -> StepTrace:
    """A trace of ``engine``'s steps at ``path``, its header read off the engine (and, on a CPU, the peaks its
    profile's efficiencies are shares of, measured now: about 2 s)."""
    from backends.sim.fit import measure_cpu_peaks
    from gateway.info import machine_summary

    runner = engine.runner
    header = {"machine": machine_summary(), "device": str(runner.device), "model": engine.model_path.name,
              "model_config": dataclasses.asdict(engine.model_config),
              "dtype": str(runner.dtype).removeprefix("torch."), "kv_dtype_bytes": runner.kv_dtype.itemsize,
              "block_size": engine.blocks.block_size, "async_scheduling": engine.overlap_steps,
              "fused_steps": getattr(runner, "fused", None) is not None}
    if str(runner.device) == "cpu":
        flops, bandwidth = measure_cpu_peaks(runner.dtype)
        header["peaks"] = {"flops": flops, "bandwidth": bandwidth}
    return StepTrace(path, header)


def load_trace(path: str | Path) -> dict[str, Any]:
    """A trace as ``sim fit --native --save-steps`` saves steps: its header with ``steps``."""
    with open(path) as f:
        return parse_trace(f)


def parse_trace(lines: Iterable[str]) -> dict[str, Any]:
    """A trace's lines (the header first) as ``load_trace`` gives them."""
    lines = iter(lines)
    header = json.loads(next(lines))
    return {**header, "steps": [json.loads(line) for line in lines if line.strip()]}
