"""`gpu-agent completion bash|zsh`: a script made from the parser tree, which offers every command, option and choice
the parser has. The bash script runs in a real bash and the zsh one in a real zsh (skipped where zsh is not
installed), each asked what it completes after every command path of the parser."""

import argparse
import shutil
import subprocess
import sys

import pytest

from gpu_agent import cli
from gpu_agent.foundations import completion


def _parsers(parser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


PARSER = cli.build_parser()
PARSERS = list(_parsers(PARSER))


def words_after(parser):
    """What may follow a command: its subcommands and its positionals' choices."""
    words = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            words += list(action.choices)
        elif not action.option_strings and action.choices:
            words += list(action.choices)
    return words


def options(parser):
    return [o for action in parser._actions for o in action.option_strings]


def test_the_command_prints_the_script_made_from_its_parser():
    for shell, make in (("bash", completion.bash), ("zsh", completion.zsh)):
        r = subprocess.run([sys.executable, "-m", "gpu_agent", "completion", shell], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout == make(PARSER)


@pytest.mark.parametrize("make", [completion.bash, completion.zsh])
def test_every_command_and_option_of_the_parser_is_in_the_script(make):
    script = make(PARSER)
    for path, parser in PARSERS:
        for word in path:
            assert word in script
        for option in options(parser):
            assert option in script, (path, option)
    table = completion.spec(PARSER)
    assert {key for key in table if key.startswith("W:")} == {"W:" + " ".join(path) for path, _ in PARSERS}
    for path, parser in PARSERS:
        assert table["O:" + " ".join(path)].split() == options(parser), path
        assert table["W:" + " ".join(path)].split() == words_after(parser), path


def bash_complete(*words, script=None):
    """What bash's completion function offers for the command line `words` (the last one being completed)."""
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    program = (f"{script or completion.bash(PARSER)}\n"
               f"COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; COMPREPLY=(); _gpu_agent\n"
               'printf "%s\\n" "${COMPREPLY[@]}"\n')
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return [line for line in r.stdout.splitlines() if line]


def test_bash_offers_after_every_command_its_subcommands_and_its_options():
    script = completion.bash(PARSER)
    for path, parser in PARSERS:
        assert bash_complete("gpu-agent", *path, "", script=script) == words_after(parser), path
        assert bash_complete("gpu-agent", *path, "-", script=script) == [o for o in options(parser)
                                                                          if o.startswith("-")], path


def test_bash_offers_an_options_values_and_knows_the_value_is_not_a_command(tmp_path):
    assert bash_complete("gpu-agent", "qu") == ["queue"]
    assert bash_complete("gpu-agent", "queue", "list", "-o", "") == ["json", "yaml", "wide"]
    assert bash_complete("gpu-agent", "queue", "list", "--output", "y") == ["yaml"]
    assert bash_complete("gpu-agent", "queue", "list", "--output", "=", "") == ["json", "yaml", "wide"]  # --output=
    assert bash_complete("gpu-agent", "completion", "") == ["bash", "zsh"]
    assert bash_complete("gpu-agent", "local", "--gpu-source", "") == ["fake", "nvml", "cluster"]  # a setting's choice
    assert bash_complete("gpu-agent", "local", "--graceful-no-gpu", "") == ["true", "false"]
    assert bash_complete("gpu-agent", "queue", "list", "--control-plane-url", "") == []  # free text
    # the value of an option is skipped: `list` after it is still a command, its options are list's
    assert bash_complete("gpu-agent", "queue", "--help", "list", "--control-plane-url", "x", "--adm") == [
        "--admin-token-file"]
    (tmp_path / "state.json").write_text("{}")
    assert bash_complete("gpu-agent", "inventory", "--fake-gpu-state-file", str(tmp_path / "st")) == [
        str(tmp_path / "state.json")]


def test_bash_accepts_the_script_and_registers_it_for_the_command():
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", completion.bash(PARSER) + "\ncomplete -p gpu-agent"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "complete -F _gpu_agent gpu-agent", r.stderr


ZSH = shutil.which("zsh")


def zsh_complete(*words, script):
    """What the zsh completion function offers for `words`: compadd and _files stand in for the completion system's
    (they print what they are given); `words` and CURRENT are set as the completion system sets them."""
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    program = ('compadd() { [[ "$1" == "--" ]] && shift; print -rl -- "$@"; }\n'
               '_files() { print -r -- "<files>"; }\n'
               'compdef() { :; }\n'
               f"{script}\n"
               f"words=({quoted}); CURRENT={len(words)}; _gpu-agent\n")
    r = subprocess.run([ZSH, "-f", "-c", program], capture_output=True, text=True, timeout=30)
    assert r.stderr == "", r.stderr
    return [line for line in r.stdout.splitlines() if line]


@pytest.mark.skipif(ZSH is None, reason="zsh is not installed here (the bash script is tested all the same)")
def test_zsh_offers_after_every_command_its_subcommands_options_and_values():
    script = completion.zsh(PARSER)
    assert subprocess.run([ZSH, "-n", "-c", script], timeout=30).returncode == 0
    for path, parser in PARSERS:
        assert zsh_complete("gpu-agent", *path, "", script=script) == words_after(parser), path
        assert zsh_complete("gpu-agent", *path, "-", script=script) == options(parser), path  # zsh filters itself
    assert zsh_complete("gpu-agent", "queue", "list", "-o", "", script=script) == ["json", "yaml", "wide"]
    assert zsh_complete("gpu-agent", "local", "--gpu-source", "", script=script) == ["fake", "nvml", "cluster"]
    assert zsh_complete("gpu-agent", "local", "--config", "", script=script) == ["<files>"]
    assert zsh_complete("gpu-agent", "queue", "--help", "list", "--control-plane-url", "x", "-", script=script) == \
        options(dict(PARSERS)[("queue", "list")])
