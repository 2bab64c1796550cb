"""Shell completion for an argparse command, read from its parser tree so that it never drifts from it.

`spec(parser)` walks the parser and its subparsers: for every command path ("", "queue", "queue list") the words
that may come next (subcommands, a positional's choices), the options, and for each option that takes a value what
its value is (its choices, a file, or anything). `bash(parser)` and `zsh(parser)` print a script that carries that
table and a small function that finds the command path in the words typed so far and offers what the table says.
Nothing is run at completion time but the shell itself: no Python start per TAB.
"""

from __future__ import annotations

import argparse
import re
import shlex

FILE = "@file"  # the value is a path: the shell completes file names
ANY = "@"  # the value is free text: nothing is offered
FILE_METAVARS = frozenset({"PATH", "FILE"})
# An action may carry the words its value can be under this attribute where argparse itself does not check them
# (a setting's choices: the settings loader checks them and names the setting in its message).
COMPLETIONS = "completions"


def _value_kind(action: argparse.Action) -> str:
    words = getattr(action, COMPLETIONS, None) or action.choices
    if words is not None:
        return " ".join(str(c) for c in words)
    return FILE if str(action.metavar or "").upper() in FILE_METAVARS else ANY


def spec(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The completion table: "W:<path>" -> the words after <path>, "O:<path>" -> its options, and
    "V:<path>:<option>" -> what the option's value is (space-separated choices, FILE or ANY)."""
    table: dict[str, str] = {}

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        words: list[str] = []
        options: list[str] = []
        subs: list[tuple[str, argparse.ArgumentParser]] = []
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    words.append(name)
                    subs.append((name, sub))
            elif not action.option_strings:
                if action.choices is not None:
                    words.extend(str(c) for c in action.choices)
            else:
                options.extend(action.option_strings)
                if action.nargs != 0:  # store, not store_true / help / version
                    for option in action.option_strings:
                        table[f"V:{path}:{option}"] = _value_kind(action)
        table[f"W:{path}"] = " ".join(words)
        table[f"O:{path}"] = " ".join(options)
        for name, sub in subs:
            walk(sub, f"{path} {name}".strip())

    walk(parser, "")
    return table


def _function_name(prog: str) -> str:
    return "_" + re.sub(r"[^A-Za-z0-9_]", "_", prog)


def _entries(table: dict[str, str], indent: str) -> str:
    return "\n".join(f"{indent}{shlex.quote(k)} {shlex.quote(v)}" for k, v in table.items())


def bash(parser: argparse.ArgumentParser) -> str:
    """A bash completion script for `parser.prog` (bash 4.3 or later: associative arrays)."""
    prog, fn = parser.prog, _function_name(parser.prog)
    pairs = "\n".join(f"        [{shlex.quote(k)}]={shlex.quote(v)}" for k, v in spec(parser).items())
    return f"""\
# bash completion for {prog}, generated from its argument parser by `{prog} completion bash`.
# Load it in this shell:  source <({prog} completion bash)
# or for every shell:     {prog} completion bash > ~/.local/share/bash-completion/completions/{prog}
{fn}() {{
    local -A spec=(
{pairs}
    )
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}" cmd="" w i
    if [[ "$cur" == "=" ]]; then cur=""; fi  # --option=<TAB>: bash splits the word at '='
    if [[ "$prev" == "=" && $COMP_CWORD -ge 2 ]]; then prev="${{COMP_WORDS[COMP_CWORD-2]}}"; fi
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${{COMP_WORDS[i]}}"
        if [[ -n "${{spec["V:$cmd:$w"]+set}}" ]]; then  # an option that takes a value: skip the value
            if [[ "${{COMP_WORDS[i+1]}}" == "=" ]]; then ((i += 1)); fi
            ((i += 1))
            continue
        fi
        if [[ "$w" == -* || "$w" == "=" ]]; then continue; fi
        if [[ " ${{spec["W:$cmd"]}} " == *" $w "* ]]; then cmd="${{cmd:+$cmd }}$w"; fi
    done
    if [[ -n "${{spec["V:$cmd:$prev"]+set}}" ]]; then
        case "${{spec["V:$cmd:$prev"]}}" in
            {FILE}) compopt -o filenames 2>/dev/null; mapfile -t COMPREPLY < <(compgen -f -- "$cur") ;;
            {ANY}) COMPREPLY=() ;;
            *) mapfile -t COMPREPLY < <(compgen -W "${{spec["V:$cmd:$prev"]}}" -- "$cur") ;;
        esac
    elif [[ "$cur" == -* ]]; then
        mapfile -t COMPREPLY < <(compgen -W "${{spec["O:$cmd"]}}" -- "$cur")
    else
        mapfile -t COMPREPLY < <(compgen -W "${{spec["W:$cmd"]}}" -- "$cur")
    fi
    return 0
}}
complete -F {fn} {prog}
"""


def zsh(parser: argparse.ArgumentParser) -> str:
    """A zsh completion script for `parser.prog`: autoloaded from $fpath as `_<prog>`, or sourced after compinit."""
    prog, fn = parser.prog, "_" + parser.prog
    return f"""\
#compdef {prog}
# zsh completion for {prog}, generated from its argument parser by `{prog} completion zsh`.
# Load it in this shell (after compinit):  source <({prog} completion zsh)
# or for every shell: {prog} completion zsh > "${{fpath[1]}}/_{prog}"  (a folder on $fpath), then compinit
{fn}() {{
    local -A spec
    spec=(
{_entries(spec(parser), "        ")}
    )
    local cur="${{words[CURRENT]}}" prev="${{words[CURRENT-1]}}" cmd="" w i
    for ((i = 2; i < CURRENT; i++)); do
        w="${{words[i]}}"
        if (( ${{+spec[V:$cmd:$w]}} )); then  # an option that takes a value: skip the value
            ((i += 1))
            continue
        fi
        if [[ "$w" == -* ]]; then continue; fi
        if [[ " ${{spec[W:$cmd]}} " == *" $w "* ]]; then cmd="${{cmd:+$cmd }}$w"; fi
    done
    if (( ${{+spec[V:$cmd:$prev]}} )); then
        case "${{spec[V:$cmd:$prev]}}" in
            {FILE}) _files ;;
            {ANY}) return 1 ;;
            *) compadd -- ${{=spec[V:$cmd:$prev]}} ;;
        esac
    elif [[ "$cur" == -* ]]; then
        compadd -- ${{=spec[O:$cmd]}}
    else
        compadd -- ${{=spec[W:$cmd]}}
    fi
}}
if [[ "${{funcstack[1]}}" == "{fn}" ]]; then
    {fn} "$@"
else
    compdef {fn} {prog}
fi
"""
