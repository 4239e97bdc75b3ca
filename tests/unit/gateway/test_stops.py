"""Stop strings over streamed text, against a plain reference (cut the whole text where a stop string first
completes):
the same text whatever the token boundaries, and only a tail that could start a stop string is held back."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.gateway.stops import StopStrings

ALPHABET = "ab c\n"


def _stream(stops, pieces):
    m = StopStrings(stops)
    sent = []
    for piece in pieces:
        sent.append(m.push(piece))
        if m.stopped:
            return "".join(sent), True, m
        so_far = "".join(pieces[:len(sent)])
        assert "".join(sent) + m.pending == so_far  # nothing lost or reordered
        # held back only while it could still become a stop string
        assert m.pending == "" or any(s.startswith(m.pending) for s in stops)
    return "".join(sent) + m.flush(), False, m


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4),
       text=st.text(ALPHABET, max_size=40), seed=st.integers(0, 2**32))
def test_any_split_gives_the_text_cut_at_the_first_stop(stops, text, seed):
    r = random.Random(seed)
    cuts = sorted(r.sample(range(1, len(text)), min(len(text) - 1, r.randrange(0, 8)))) if len(text) > 1 else []
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    # reference: the first character at which some stop string completes; the earliest such occurrence
    ends = [(j, j - len(s)) for j in range(len(text) + 1) for s in stops if text[:j].endswith(s)]
    got, stopped, _ = _stream(stops, pieces)
    assert stopped == bool(ends)
    assert got == (text[:min(ends)[1]] if ends else text)


def test_stop_across_token_boundaries():
    got, stopped, _ = _stream(["END"], ["hello E", "N", "D and more"])
    assert (got, stopped) == ("hello ", True)


def test_a_false_start_is_released_when_it_cannot_be_a_stop():
    m = StopStrings(["END"])
    assert m.push("hello E") == "hello "
    assert m.pending == "E"
    assert m.push("Nx") == "ENx"
    assert not m.stopped


def test_no_stops_holds_nothing_back():
    m = StopStrings([])
    assert m.push("abc") == "abc" and m.pending == "" and not m.stopped
