"""`logFormat` (every command's --log-format, GPU_AGENT_LOG_FORMAT): text, klog's line as it always was, or json, one
object a line with the keys of Kubernetes' structured JSON logging, for log pipelines (issue 50). Both formats redact
the same secrets wherever they come from, and show the same lines at each verbosity."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys

import jsonschema
import pytest

from gpu_agent.foundations import klog
from gpu_agent.foundations.secrets import REDACTOR

# What a JSON line is: every key always there, each of one type; nothing else. A log pipeline's parser can rely on it.
LINE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ts", "level", "v", "logger", "caller", "msg", "pid", "thread", "err"],
    "properties": {
        "ts": {"type": "number", "minimum": 1e9},  # Unix seconds, with the fraction
        "level": {"enum": ["info", "warning", "error", "fatal"]},
        "v": {"type": "integer", "minimum": 0},
        "logger": {"type": "string", "minLength": 1},
        "caller": {"type": "string", "pattern": r"^[^\s:]+\.py:[0-9]+$"},
        "msg": {"type": "string"},
        "pid": {"type": "integer", "minimum": 1},
        "thread": {"type": "string", "minLength": 1},
        "err": {"type": ["string", "null"]},
    },
}
KLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [^ ]+\.py:\d+\] ")


@pytest.fixture
def logs():
    """setup(v, fmt) -> the stream the gpu_agent loggers write to; the logging set-up is put back afterwards."""
    root = logging.getLogger(klog.ROOT)
    saved = (list(root.handlers), root.level, root.propagate)

    def setup(verbosity, log_format="text"):
        stream = io.StringIO()
        klog.setup(verbosity, stream, log_format=log_format)
        return stream

    yield setup
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    root.propagate = saved[2]


def record(msg="hello %s", args=("world",), level=logging.INFO, exc_info=None):
    r = logging.LogRecord("gpu_agent.roles.cluster_agent", level, "/x/gpu_agent/roles/cluster_agent.py", 42, msg,
                          args, exc_info)
    r.created, r.msecs, r.process, r.threadName = 1732920220.123456, 123.456, 12345, "MainThread"
    return r


def test_the_default_text_line_is_byte_for_byte_klogs():
    """The text format is the line every release wrote (checked against main's KlogFormatter when this was added)."""
    fmt = klog.formatter()
    assert isinstance(fmt, klog.KlogFormatter) and type(klog.formatter("text")) is klog.KlogFormatter
    assert fmt.format(record()) == "I1129 22:43:40.123456   12345 cluster_agent.py:42] hello world"
    assert fmt.format(record(level=logging.WARNING)) == "W1129 22:43:40.123456   12345 cluster_agent.py:42] hello world"
    assert fmt.format(record(level=klog._level_for_v(4))) == "I1129 22:43:40.123456   12345 cluster_agent.py:42] hello world"
    assert fmt.format(record("a\nforged line", ())) == "I1129 22:43:40.123456   12345 cluster_agent.py:42] a\\nforged line"
    try:
        raise ValueError("boom")
    except ValueError:
        text = fmt.format(record(level=logging.ERROR, exc_info=sys.exc_info()))
    head, *trace = text.split("\n")
    assert head == "E1129 22:43:40.123456   12345 cluster_agent.py:42] hello world"
    assert trace[0] == "Traceback (most recent call last):" and trace[-1] == "ValueError: boom"


def test_setup_without_a_format_writes_text(logs):
    logs(0)  # for the fixture's restore; then as every caller before logFormat called it
    stream = io.StringIO()
    klog.setup(0, stream)
    klog.get_logger("roles.x").info("started %s", "ok")
    (line,) = stream.getvalue().splitlines()
    assert KLOG_LINE.match(line) and " test_log_format.py:" in line and line.endswith("] started ok"), line


def test_json_lines_parse_and_hold_the_stable_keys_and_types(logs):
    stream = logs(7, "json")
    log = klog.get_logger("roles.cluster_agent")
    log.info("registered as %s", "agent-1")
    log.v(3, "gate %s open", "g")
    log.warning("a warning with a \"quote\", a tab\t, a newline\nand é")
    try:
        raise RuntimeError("it broke")
    except RuntimeError:
        log.error("the call failed", exc_info=True)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4  # one record, one line: the traceback and the newline are escaped inside it
    docs = [json.loads(line) for line in lines]
    for line, doc in zip(lines, docs, strict=True):
        jsonschema.validate(doc, LINE_SCHEMA)
        assert list(doc) == list(klog.JSON_KEYS)  # the same keys in the same order, always
        assert line.isascii()
    assert set(LINE_SCHEMA["properties"]) == set(klog.JSON_KEYS)
    info, v3, warning, error = docs
    assert (info["level"], info["v"], info["msg"], info["err"]) == ("info", 0, "registered as agent-1", None)
    assert (v3["level"], v3["v"], v3["msg"]) == ("info", 3, "gate g open")
    assert (warning["level"], warning["v"]) == ("warning", 0)
    assert warning["msg"] == "a warning with a \"quote\", a tab\t, a newline\nand é"
    assert (error["level"], error["msg"]) == ("error", "the call failed")
    assert error["err"].startswith("Traceback (most recent call last):") and error["err"].endswith("RuntimeError: it broke")
    assert info["logger"] == "gpu_agent.roles.cluster_agent"
    assert info["caller"].startswith("test_log_format.py:") and isinstance(info["ts"], float)
    assert info["thread"] == "MainThread" and info["pid"] > 0
    fatal = json.loads(klog.formatter("json").format(record(level=logging.CRITICAL)))
    assert fatal["level"] == "fatal" and fatal["ts"] == 1732920220.123456 and fatal["pid"] == 12345


# A plain credential, and one that JSON escapes (a quote, a backslash, a non-ASCII letter): scrubbing only the
# finished line would miss the second, which is written there as `pa\"ss\\w\u00f6rd...`.
SECRETS = ["cred-7d9f0a1b2c3d4e5f-plain", 'pa"ss\\wörd-31415926']


@pytest.mark.parametrize("log_format", klog.FORMATS)
@pytest.mark.parametrize("secret", SECRETS, ids=["plain", "escaped-in-json"])
def test_a_registered_secret_never_appears_in_the_message_an_argument_or_an_exception(logs, log_format, secret):
    REDACTOR.register(secret)
    stream = logs(0, log_format)
    log = klog.get_logger("roles.registration")
    log.info(f"the token is {secret} in the message")
    log.info("the token is %s as an argument", secret)
    try:
        raise PermissionError(f"refused credential {secret}")
    except PermissionError:
        log.error("registration failed", exc_info=True)
    out = stream.getvalue()
    for form in (secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1], "cred-7d9f", "31415926"):
        assert form not in out, (form, out)
    assert out.count("<redacted>") == 3
    if log_format == "json":
        message, argument, exception = (json.loads(line) for line in out.splitlines())
        assert message["msg"] == "the token is <redacted> in the message"
        assert argument["msg"] == "the token is <redacted> as an argument"
        assert exception["err"].endswith("PermissionError: refused credential <redacted>")


def shown(stream, log_format):
    """The messages a stream holds, whichever the format (text: after the klog head)."""
    lines = [line for line in stream.getvalue().splitlines() if not line.startswith((" ", "Traceback"))]
    if log_format == "json":
        return [json.loads(line)["msg"] for line in lines]
    return [KLOG_LINE.sub("", line) for line in lines]


@pytest.mark.parametrize("verbosity", [0, 1, 2, 4, 6, 7])
def test_verbosity_shows_the_same_lines_in_both_formats(logs, verbosity):
    seen = {}
    for log_format in klog.FORMATS:
        stream = logs(verbosity, log_format)
        log = klog.get_logger("roles.v")
        for n in range(8):
            log.v(n, "at V(%d)", n)
        log.info("info")
        log.warning("warning")
        log.error("error")
        seen[log_format] = shown(stream, log_format)
    expected = [f"at V({n})" for n in range(verbosity + 1)] + ["info", "warning", "error"]
    assert seen["text"] == seen["json"] == expected


def test_a_bad_log_format_names_the_setting_and_how_to_set_it():
    import argparse

    from gpu_agent.foundations.config import LOGGING, ConfigError, RoleConfig, load

    with pytest.raises(ConfigError) as e:
        load(LOGGING, argparse.Namespace(logFormat="xml"), {}, as_=RoleConfig)
    assert str(e.value) == ("invalid value for logFormat (from flag --log-format): must be one of text, json, got "
                            "'xml'; set it with --log-format or GPU_AGENT_LOG_FORMAT")
    with pytest.raises(ConfigError, match=r"logFormat \(from environment GPU_AGENT_LOG_FORMAT\)"):
        load(LOGGING, argparse.Namespace(), {"GPU_AGENT_LOG_FORMAT": "JSON"}, as_=RoleConfig)
    assert load(LOGGING, argparse.Namespace(), {}, as_=RoleConfig).logFormat == "text"
    with pytest.raises(ValueError, match="logFormat"):
        klog.formatter("xml")


def test_every_command_takes_the_log_format():
    from gpu_agent import cli

    parser = cli.build_parser()
    commands = [*cli.ROLES, "inventory", "queue list", "queue add key"]
    for command in commands:
        args = parser.parse_args([*command.split(), "--log-format", "json"])
        assert args.logFormat == "json", command


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_setting_reaches_a_real_process_whose_every_line_is_json_and_redacted(tmp_path, how):
    """A cluster agent with no GPUs logs its configuration and exits 3 by itself, saying why in its last line."""
    import os

    from gpu_agent.foundations import fake_state
    from gpu_agent.foundations.gpus import Inventory

    state = tmp_path / "fake-gpus.json"
    fake_state.write_atomic(state, fake_state.render(Inventory(), node="n"))
    token = "registration-token-0f1e2d3c4b5a69788"
    argv = ["--fake-gpu-state-file", str(state), "--listen-address", "127.0.0.1:0", "-v", "2",
            "--executor-journal", str(tmp_path / "journal.sqlite"), "--control-plane-url", f"http://127.0.0.1:{free_port()}"]
    env = {**os.environ, "GPU_AGENT_CONTROL_PLANE_TOKEN": token}
    if how == "flag":
        argv += ["--log-format", "json"]
    else:
        env["GPU_AGENT_LOG_FORMAT"] = "json"
    r = subprocess.run([sys.executable, "-m", "gpu_agent", "cluster-agent", *argv], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 3, r.stderr[-2000:]
    docs = [json.loads(line) for line in r.stderr.splitlines()]  # every line: not one klog line left
    assert len(docs) >= 3
    for doc in docs:
        jsonschema.validate(doc, LINE_SCHEMA)
    assert token not in r.stderr and token not in r.stdout
    assert any(d["msg"].strip() == "controlPlaneToken: <redacted>" for d in docs), [d["msg"] for d in docs]
    assert any(d["msg"].strip() == "logFormat: json" for d in docs)
    assert docs[-1]["level"] == "error" and docs[-1]["msg"].endswith("gracefulNoGPU is off: exiting (set "
                                                                        "gracefulNoGPU=true to wait for GPUs live but NotReady)")


def test_a_bad_value_stops_a_real_process_with_code_2_naming_the_setting():
    r = subprocess.run([sys.executable, "-m", "gpu_agent", "control-plane", "--log-format", "xml"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == ("gpu-agent control-plane: error: invalid value for logFormat (from flag --log-format): "
                                "must be one of text, json, got 'xml'; set it with --log-format or GPU_AGENT_LOG_FORMAT")
