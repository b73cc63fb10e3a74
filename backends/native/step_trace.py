"""Each step's batch and how long it took while the engine serves: the data a simulator profile is fitted on
when the steps timed in-process leave out what serving adds (the HTTP server and the gateway sharing the host,
streaming, a step's host work beside the device's), so that ``burstgate sim fit --from TRACE`` fits on the
steps the engine really ran.

A trace is JSON lines: a header (the model's shape, dtype, block size, how steps run, this CPU's peaks), then one
``[query_lens, context_lens, sampled_rows, seconds, shared_kv_tokens, admitted]`` per step (``Batch.shared_kv_tokens``,
``Batch.admitted``; a trace written before either has the first four or five), the same as the steps ``sim fit
--native --save-steps`` writes. The requests a step admitted are a record, not a term of the step-time model: a cost
per admission fitted on served steps came out zero (benchmarks/turn_steps.py splits steps by it). On a
CPU the peaks are measured again as the trace closes, a last line ``{"peaks": ...}``, and a reader takes the higher
of each: a host busy at one measurement reads low, never high, and a fit's efficiencies are shares of the peaks.

A step's seconds are its share of the engine's time line: from the end of the step before it to its own end (its
tokens sampled) while the engine has work, the host's bookkeeping between steps included; from its own start after
the engine idled. Ends are read on the device's clock: on a GPU, events on the stream, so that a step launched
ahead (async scheduling) ends when the device finishes it, not when the host next looks (a host that blocks in one
step's launch would otherwise move time from that step to the one before).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from backends.native.batch import Batch

FLUSH_EVERY = 64  # steps buffered before a write: the engine thread writes rarely, a reader sees recent steps


class StepClock(Protocol):
    """Marks on the device's time line: ``mark()`` now in the order of the device's work, ``seconds(a, b)``
    between two marks once the device has passed both."""

    def mark(self) -> Any: ...

    def seconds(self, a: Any, b: Any) -> float: ...


class HostClock:
    """A CPU's steps run in the calling thread: the host's clock is the device's."""

    def mark(self) -> float:
        """Now."""
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        """From ``a`` to ``b``."""
        return b - a


class CudaClock:
    """Events on the engine's CUDA stream: a mark is passed when the device reaches it."""

    def __init__(self, device: Any) -> None:
        self.device = device  # the engine's GPU, which need not be the thread's current one

    def mark(self) -> Any:
        """An event behind the work enqueued so far on the device's current stream."""
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, a: Any, b: Any) -> float:
        """From ``a`` to ``b`` on the device; steps are written once finished, so ``b``'s wait is short: at
        most the event's own distance behind the step's sampled tokens, which the host has read."""
        b.synchronize()
        return a.elapsed_time(b) / 1e3


@dataclass
class _Launched:
    work: list  # [query_lens, context_lens, sampled rows]
    shared_kv_tokens: int
    admitted: int
    begin: Any  # the clock's marks: where its share of the time line begins, and its tokens sampled
    done: Any


class StepTrace:
    """Appends the engine's steps to a trace file (JSON lines)."""

    def __init__(self, path: str | Path, header: dict[str, Any], clock: StepClock | None = None,
                 measure_peaks: Callable[[], dict[str, float]] | None = None) -> None:
        try:
            self._file: IO[str] = open(path, "w")  # noqa: SIM115 - open for the engine's life, closed by close()
        except OSError as exc:
            raise ValueError(f"step_trace: cannot write {str(path)!r}: {exc.strerror}") from None
        self._file.write(json.dumps({"what": "native engine steps timed while served, for `burstgate sim fit "
                                             "--from`", **header}) + "\n")
        self._file.flush()
        self.clock: StepClock = clock or HostClock()
        self._measure_peaks = measure_peaks  # again as the trace closes (a CPU's)
        self._block_size: int = header["block_size"]
        self._lines: list[str] = []
        self._launched: list[_Launched] = []  # not written yet, in launch order
        self._last_done: Any = None  # the last step's end, while the engine has had work since

    def launched(self, batch: Batch, start: Any, done: Any) -> None:
        """A step's ``batch``, launched between the clock's marks ``start`` (before its work) and ``done`` (after
        its tokens are sampled; on a GPU, enqueued)."""
        begin = start if self._last_done is None else self._last_done
        self._launched.append(_Launched([list(batch.query_lens), list(batch.context_lens), sum(batch.sample)],
                                        batch.shared_kv_tokens(self._block_size), batch.admitted, begin, done))
        self._last_done = done

    def called(self, in_flight: bool, more: bool) -> None:
        """The end of one call of the engine's ``step()``: ``in_flight`` if the step it launched last is still on
        the device (async scheduling), ``more`` if the engine has work left."""
        finished = self._launched[:-1] if in_flight else self._launched
        self._lines += [json.dumps([*step.work, self.clock.seconds(step.begin, step.done), step.shared_kv_tokens,
                                    step.admitted]) + "\n" for step in finished]
        del self._launched[:len(finished)]
        if not more:
            self._last_done = None
        if not more or len(self._lines) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Write the steps buffered so far."""
        if self._lines:
            self._file.writelines(self._lines)
            self._file.flush()
            self._lines.clear()

    def close(self) -> None:
        """Write every step launched (one still on the device is waited for) and close the file."""
        with contextlib.suppress(RuntimeError):  # a failed device cannot time its last steps: they are left out
            self.called(in_flight=False, more=False)
        self.flush()
        if self._measure_peaks is not None:
            self._file.write(json.dumps({"peaks": self._measure_peaks()}) + "\n")
        self._file.close()


def open_trace(path: str | Path, engine) -> StepTrace:
    """A trace of ``engine``'s steps at ``path``, its header read off the engine (and, on a CPU, the peaks its
    profile's efficiencies are shares of, measured now: about 2 s)."""
    from backends.native.fused_step import fused_rows
    from backends.sim.fit import measure_cpu_peaks
    from gateway.info import machine_summary

    runner = engine.runner
    header = {"machine": machine_summary(), "device": str(runner.device), "model": engine.model_path.name,
              "model_config": dataclasses.asdict(engine.model_config),
              "dtype": str(runner.dtype).removeprefix("torch."), "kv_dtype_bytes": runner.kv_dtype.itemsize,
              "block_size": engine.blocks.block_size, "async_scheduling": engine.overlap_steps,
              "fused_steps": getattr(runner, "fused", None) is not None,
              "fused_rows": fused_rows(getattr(runner, "fused", None))}
    if runner.device.type != "cpu":
        return StepTrace(path, header, CudaClock(runner.device) if runner.device.type == "cuda" else HostClock())

    def peaks() -> dict[str, float]:
        flops, bandwidth = measure_cpu_peaks(runner.dtype)
        return {"flops": flops, "bandwidth": bandwidth}

    header["peaks"] = peaks()
    return StepTrace(path, header, HostClock(), measure_peaks=peaks)


def load_trace(path: str | Path) -> dict[str, Any]:
    """A trace as ``sim fit --native --save-steps`` saves steps: its header with ``steps``."""
    with open_text(path) as f:
        return parse_trace(f)


def open_text(path: str | Path) -> IO[str]:
    """A trace or saved-steps file for reading, gzipped where its name ends in ``.gz`` (a GPU's trace runs to
    megabytes: committed compressed)."""
    return gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)


def parse_trace(lines: Iterable[str]) -> dict[str, Any]:
    """A trace's lines (the header first) as ``load_trace`` gives them: its steps, and each peak the highest
    measured."""
    lines = iter(lines)
    header = json.loads(next(lines))
    steps = []
    for record in (json.loads(line) for line in lines if line.strip()):
        if isinstance(record, dict):  # the peaks measured again as the trace closed
            header["peaks"] = {k: max(v, record["peaks"][k]) for k, v in header["peaks"].items()}
        else:
            steps.append(record)
    return {**header, "steps": steps}
