"""Stop strings with vLLM's semantics for any stream of text deltas: the text is cut before the first
stop string and no part of a stop string is ever streamed.

Shared by the native engine's detokeniser and by adapters whose servers keep the stop string in their
output (TGI, LightLLM, MII) or do not support stop strings at all.
"""

from __future__ import annotations


class StopStringFilter:
    """Holds back the last ``len(longest stop) - 1`` characters, which could be the start of a stop string."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text so far, cut at the stop string once one is found
        self.emitted = 0  # characters of ``text`` already returned
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        """Add a delta; returns (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        search_from = max(len(self.text) - self.hold_back, 0)
        self.text += delta
        hits = [at for s in self.stop if (at := self.text.find(s, search_from)) != -1]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
            return self._take(len(self.text)), True
        return self._take(len(self.text) - self.hold_back), False

    def flush(self) -> str:
        """Whatever is held back, at the end of generation."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta
