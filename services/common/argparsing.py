"""The `pdserve` parser class: every sub-command's help states each option's default (issue 11), without every
add_argument in services/*/main.py having to say it, and `--version` reads the installed package's version."""
from __future__ import annotations

import argparse
import copy
from importlib import metadata

# options whose value is the switch itself: "(default: False)" would say nothing
SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
            argparse._AppendConstAction, argparse._CountAction, argparse._HelpAction, argparse._VersionAction)


def shows_default(action: argparse.Action) -> bool:
    """Whether the help must state a default: an option that takes a value and has one."""
    return (bool(action.option_strings) and not isinstance(action, SWITCHES) and action.nargs != 0
            and action.default is not None and action.default is not argparse.SUPPRESS)


def states_default(text: str) -> bool:
    """A help that already says "default: ..." in words (e.g. "default: the model's max_position_embeddings")."""
    return "%(default)" in text or "default:" in text.lower()


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option that has a default, also to those added without a help text,
    unless its help already states the default."""

    def _format_action(self, action):
        if shows_default(action) and not (action.help or "").strip():
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if shows_default(action) and not states_default(text):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose sub-parsers (add_subparsers makes them of this class) use DefaultsHelpFormatter."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kw)


class VersionAction(argparse.Action):
    """`--version`: the version pip installed (pyproject's), read when asked; a checkout run without an install
    has no package metadata and says so instead of printing a guess."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            version = metadata.version("pdserve")
        except metadata.PackageNotFoundError:
            parser.exit(1, "pdserve: no installed package metadata (run from a checkout without `pip install .`)\n")
        print(f"pdserve {version}")
        parser.exit(0)
