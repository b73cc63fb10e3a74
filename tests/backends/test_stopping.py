"""StopStringFilter: whatever the split into deltas, the output is the text cut before the first stop
string, and nothing after the cut is ever emitted."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from backends.stopping import StopStringFilter

ALPHABET = "ab c"


def reference(deltas: list[str], stops: list[str]) -> tuple[str, bool]:
    """The text as generated: it ends with the first delta that completes a stop string (nothing after it is
    generated), cut before the earliest stop string in it."""
    text = ""
    for d in deltas:
        text += d
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], True
    return text, False


@settings(max_examples=400, derandomize=True)
@given(st.lists(st.text(ALPHABET, max_size=4), max_size=12), st.lists(st.text(ALPHABET, min_size=1, max_size=3),
                                                                      max_size=3))
def test_cut_matches_the_whole_text_cut(deltas, stops):
    f = StopStringFilter(stops)
    out, stopped = "", False
    for d in deltas:
        emitted, stopped = f.push(d)
        out += emitted
        expected, _ = reference(deltas, stops)
        assert expected.startswith(out)  # never emits anything the final answer does not contain
        if stopped:
            break
    out += f.flush()
    assert (out, stopped) == reference(deltas, stops)


def test_holds_back_a_possible_stop_prefix_until_it_is_decided():
    f = StopStringFilter(["</end>"])
    assert f.push("Hello </e") == ("Hell", False)  # 5 = len("</end>") - 1 characters held
    assert f.push("nd> more") == ("o ", True)
    assert f.flush() == ""
