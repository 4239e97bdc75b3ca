"""Stop strings over streamed text: the text ends before the first stop string to complete, also one split across
tokens.

Streaming holds back only the tail that could still be the start of a stop string, so a client never receives
text that a later token turns into part of a stop string, and is never made to wait for text that cannot be.
"""
from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.pending = ""  # held back: a suffix of the text so far that some stop string starts with
        self.stopped = False

    def push(self, text: str) -> str:
        """The text that can be sent now; sets `stopped` (and drops everything after) once a stop string is
        complete. Text sent before never overlaps a stop string: its tail that could was held back."""
        if self.stopped:
            raise RuntimeError("text pushed after a stop string ended the output")
        if not self.stops:  # nothing to hold back or find (most requests)
            return text
        buf = self.pending + text
        # (end, start) of each stop string's first occurrence: the output stops where a stop string first
        # completes, whatever the token boundaries, and at its earliest start when several complete there
        hits = [(i + len(s), i) for s, i in ((s, buf.find(s)) for s in self.stops) if i >= 0]
        if hits:
            self.pending, self.stopped = "", True
            return buf[:min(hits)[1]]
        hold = self._partial(buf)
        self.pending = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """At the end of the output the held-back tail was not a stop string after all."""
        out, self.pending = self.pending, ""
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        for k in range(min(len(buf), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
