"""`pdserve --help` of every sub-command states each option's default (issue 11), and `--version` prints
pyproject's version."""
from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from pdserve import cli

ROOT = Path(__file__).resolve().parents[2]
# the value is the switch itself, or the option exits: no default to state
NO_VALUE = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
            argparse._AppendConstAction, argparse._CountAction, argparse._HelpAction)


def sub_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser([], load_all=True)
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subs) == 1
    return dict(subs[0].choices)


def help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The lines `--help` prints for one option, with the sub-parser's own formatter, whitespace collapsed."""
    return " ".join(parser._get_formatter()._format_action(action).split())


def test_every_sub_command_is_walked():
    assert set(sub_parsers()) >= {*cli.SERVICES, "up", "generate", "make-model", "make-certs", "health", "bench"}


@pytest.mark.parametrize("name", sorted(sub_parsers()))
def test_every_option_shows_its_default(name):
    parser = sub_parsers()[name]
    missing = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, NO_VALUE) or action.nargs == 0:
            continue
        if action.default is None or action.default is argparse.SUPPRESS:
            continue  # no default: nothing to state
        text = help_of(parser, action)
        if f"(default: {action.default})" not in text and "default:" not in text.lower():
            missing.append(f"{action.option_strings[0]} (default {action.default!r}): {text}")
    assert missing == []
    assert parser.format_help()  # every help text formats (a stray % would raise here)


def test_a_switch_and_a_valueless_option_state_no_default():
    up = sub_parsers()["up"]
    free = next(a for a in up._actions if "--free-ports" in a.option_strings)
    tls_dir = next(a for a in up._actions if "--tls-dir" in a.option_strings)
    assert "default: False" not in help_of(up, free)
    assert "(default: None)" not in help_of(up, tls_dir)


def test_version_is_pyprojects(capsys):
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"pdserve {want}\n"


def test_generate_has_a_flag_for_every_optional_request_field():
    """build_request reads each client.OPTIONAL name off the parsed arguments: a name without a flag is an
    AttributeError on every `pdserve generate`."""
    from pdserve import client
    parsed = sub_parsers()["generate"].parse_args([])
    assert [n for n in client.OPTIONAL if not hasattr(parsed, n)] == []
    req = client.build_request(**{n: getattr(parsed, n) for n in client.OPTIONAL})
    assert [f.name for f, _ in req.ListFields() if f.name in client.OPTIONAL] == []
    parsed = sub_parsers()["generate"].parse_args(["--min-p", "0.25", "--min-tokens", "3", "--json-object"])
    req = client.build_request(**{n: getattr(parsed, n) for n in client.OPTIONAL})
    assert (round(req.min_p, 6), req.min_tokens, req.json_object) == (0.25, 3, True)
