"""Discovery of backends: specs, DNS re-resolution (a fake resolver), files re-read on change, and the union
reported only when it changes."""
import asyncio
import os

import pytest

from pdserve.gateway.discovery import Discovery, DnsSource, FileSource, is_ip, parse_spec, split_host_port


class FakeResolver:
    def __init__(self, answers):
        self.answers = list(answers)
        self.asked = []

    async def __call__(self, name, port):
        self.asked.append((name, port))
        a = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(a, Exception):
            raise a
        return [f"{h}:{port}" for h in a]


def run(coro):
    return asyncio.run(coro)


def test_specs_parse_and_bad_ones_are_refused_with_the_spec():
    src = parse_spec("dns:pdserve-decode-pods:50054")
    assert isinstance(src, DnsSource) and (src.name, src.port) == ("pdserve-decode-pods", 50054)
    assert isinstance(parse_spec("file:/tmp/x"), FileSource)
    for bad in ("dns:name", "srv:x:1", "file:", "pdserve-decode:50054", "dns:name:port"):
        with pytest.raises(ValueError, match="expected"):
            parse_spec(bad)
    assert split_host_port("[::1]:5") == ("::1", 5)
    assert is_ip("10.0.0.7") and is_ip("::1") and not is_ip("pdserve-decode")


def test_dns_is_re_resolved_and_a_failed_lookup_keeps_the_last_answer():
    resolver = FakeResolver([["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"], OSError("SERVFAIL"),
                             ["10.0.0.3"]])
    seen = []
    d = Discovery("decode", [], ["dns:pods:50054"], lambda t, disc: seen.append((t, disc)), resolver=resolver)

    async def go():
        for _ in range(4):
            await d.refresh()
    run(go())
    assert resolver.asked == [("pods", 50054)] * 4
    assert [t for t, _ in seen] == [{"10.0.0.1:50054", "10.0.0.2:50054"}, {"10.0.0.2:50054", "10.0.0.3:50054"},
                                    {"10.0.0.3:50054"}]
    assert all(t == disc for t, disc in seen)  # every one came from a lookup


def test_file_is_re_read_on_change_only_and_a_bad_file_keeps_the_last_list(tmp_path):
    path = tmp_path / "decodes"
    path.write_text("# decodes\n10.0.0.1:50054\n\n10.0.0.2:50054  # second\n")
    seen = []
    d = Discovery("decode", ["static:1"], [f"file:{path}"], lambda t, disc: seen.append((t, disc)))
    run(d.refresh())
    assert seen == [({"static:1", "10.0.0.1:50054", "10.0.0.2:50054"}, {"10.0.0.1:50054", "10.0.0.2:50054"})]
    run(d.refresh())
    assert len(seen) == 1  # unchanged: not reported again
    path.write_text("10.0.0.2:50054\n10.0.0.3:50054\n")
    os.utime(path, ns=(1, 10**18))  # a rewrite within one mtime tick must still be seen
    run(d.refresh())
    assert seen[-1][0] == {"static:1", "10.0.0.2:50054", "10.0.0.3:50054"}
    path.write_text("10.0.0.9:50054\nnot-a-target\n")
    run(d.refresh())
    assert seen[-1][0] == {"static:1", "10.0.0.2:50054", "10.0.0.3:50054"} and len(seen) == 2
    path.unlink()
    run(d.refresh())
    assert len(seen) == 2
    path.write_text("")
    run(d.refresh())
    assert seen[-1] == ({"static:1"}, set())  # an empty file is an answer: every discovered decode is gone


def test_run_follows_changes_at_its_interval(tmp_path):
    path = tmp_path / "prefills"
    path.write_text("a:1\n")
    seen = []
    d = Discovery("prefill", [], [f"file:{path}"], lambda t, disc: seen.append(t), interval_s=0.01)

    async def go():
        task = asyncio.ensure_future(d.run())
        await asyncio.sleep(0.05)
        path.write_text("a:1\nb:2\n")
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(seen) == 2:
                break
        task.cancel()
    run(go())
    assert seen == [{"a:1"}, {"a:1", "b:2"}]
