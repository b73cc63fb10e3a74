"""When generation stops, with vLLM's rules, in one place for every backend.

``StopChecker`` applies them token by token for the engines that sample themselves (the native engine,
DeepSpeed-Inference): a stop token (EOS unless ``ignore_eos``, or one of ``stop_token_ids``) ends with
"stop" and its text is left out; then the length limit ends with "length"; stop strings count only in
text generated after ``min_tokens`` (vLLM: vllm/v1/core/sched/utils.py ``check_stop`` and
vllm/v1/engine/detokenizer.py). ``StopStringFilter`` cuts text at stop strings for any stream of text
deltas, also for adapters whose servers keep the stop string in their output (TGI, LightLLM, MII).
"""

from __future__ import annotations

from backends.base import FinishReason, SamplingParams
from backends.tokenizer import IncrementalDetokenizer


class StopStringFilter:
    """Holds back the last ``len(longest stop) - 1`` characters, which could be the start of a stop string."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text so far, cut at the stop string once one is found
        self.emitted = 0  # characters of ``text`` already returned
        self.stopped = False
        self.hit: str | None = None  # the stop string found (the first one in the text)

    def push(self, delta: str, search: bool = True) -> tuple[str, bool]:
        """Add a delta; returns (text safe to emit now, whether a stop string was hit). With ``search``
        off the delta is only held back: a stop string ending in a later delta may still start in it."""
        if not self.stop:
            return delta, False
        if self.stopped:
            return "", True
        search_from = max(len(self.text) - self.hold_back, 0)
        self.text += delta
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) != -1] if search else []
        if hits:
            at, self.hit = min(hits)
            self.text = self.text[:at]
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


class StopChecker:
    """The stop rules for one sequence, fed one sampled token at a time. ``stop_reason`` says what ended it
    as vLLM reports it: the stop string or the ``stop_token_ids`` entry, None for EOS and the length limit."""

    def __init__(self, params: SamplingParams, detokenizer: IncrementalDetokenizer | None, eos_token_ids: frozenset[int],
                 max_tokens: int, max_model_len: int) -> None:
        """``max_tokens`` is the request's, resolved (what the context leaves when it gave none); without a
        ``detokenizer`` (``detokenize: false``) no text is made."""
        self.min_tokens = params.min_tokens
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.detokenizer = detokenizer
        self.strings = StopStringFilter(params.stop)
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.num_output = 0
        self.stop_reason: int | str | None = None

    def add(self, token_id: int, num_tokens: int) -> tuple[str, FinishReason | None]:
        """(text to emit, finish reason or None) after ``token_id``; ``num_tokens``: prompt + output now."""
        self.num_output += 1
        if token_id in self.eos_token_ids or token_id in self.stop_token_ids:  # masked until min_tokens
            self.stop_reason = None if token_id in self.eos_token_ids else token_id
            return self.strings.flush(), "stop"
        piece = self.detokenizer.add(token_id) if self.detokenizer is not None else ""
        text, hit = self.strings.push(piece, search=self.num_output > self.min_tokens)
        if hit:
            self.stop_reason = self.strings.hit
            return text, "stop"
        if self.ends_by_length(self.num_output, num_tokens):
            return text + self.strings.flush(), "length"
        return text, None

    def ends_by_length(self, num_output: int, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens (prompt + output), ``num_output`` of them generated, has
        reached its length limit, whatever its last token."""
        return num_output >= self.max_tokens or num_tokens >= self.max_model_len
