"""Issue 31 item 15: ``--help`` states every default (``serve --help`` gave none for the
connection limits)."""

from __future__ import annotations

import argparse
import subprocess
import sys


def test_every_option_with_a_default_says_it_in_its_help():
    from rallypoint.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    silent = []
    for command, sp in sub.choices.items():
        for a in sp._actions:
            if (not a.option_strings or a.default in (None, False, argparse.SUPPRESS)
                    or isinstance(a, (argparse._StoreTrueAction, argparse._HelpAction))):
                continue
            if "%(default)s" not in (a.help or "") and str(a.default) not in (a.help or ""):
                silent.append(f"{command} {a.option_strings[0]} (default {a.default!r})")
    assert not silent, silent


def test_serve_help_shows_the_connection_limits_defaults():
    out = subprocess.run([sys.executable, "-m", "rallypoint", "serve", "--help"], capture_output=True, text=True,
                         timeout=60, env={"COLUMNS": "200", "PATH": ""})
    assert out.returncode == 0, out.stderr
    import re

    options = out.stdout[out.stdout.index("options:"):]
    for option, default in (("--max-connections", "1024"), ("--max-inflight", "256"), ("--drain-timeout", "30.0"),
                            ("--max-outgoing-bytes", "4194304"), ("--handshake-timeout", "10.0")):
        # the option's own help: from its line to the next line that starts an option
        m = re.search(rf"^  {option} [A-Z_]+\n?(.*?)(?=^  -)", options, re.M | re.S)
        assert m and f"(default {default})" in " ".join(m.group(1).split()), (option, m and m.group(1))
