"""Every command-line option explains itself, and one concept has one spelling."""

from __future__ import annotations

import argparse

import pytest

from pdproxy.cli import build_parser


def subcommand(name: str) -> argparse.ArgumentParser:
    commands = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    parser = commands.choices[name]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("command", ["announce", "fake-worker"])
def test_every_option_has_help_and_says_its_default(command: str) -> None:
    for action in options(subcommand(command)):
        flag = action.option_strings[0]
        assert action.help, f"{command} {flag} has no help"
        shown = action.default not in (None, False, argparse.SUPPRESS)
        if shown and not action.required:
            assert "default" in action.help, f"{command} {flag} hides its default"


def test_one_spelling_per_option_across_commands() -> None:
    flags = {
        flag
        for command in ("serve", "announce", "fake-worker")
        for action in options(subcommand(command))
        for flag in action.option_strings
    }
    # Pairs that would name one thing twice.
    assert "--is-mla" not in flags and "--mla" in flags
    for flag in flags:
        assert not flag.startswith("--is-"), flag
