"""Configuration from flags, environment and an optional YAML file, validated at start.

Each role declares its settings as a list of `Setting`s, and a `Config` subclass that names each
of them with the type it holds once loaded (`leaseSeconds: float`), so that every read of a setting
is typed; `load` holds the class to the table (a setting missing from either, or declared with
another type, is a programming error found at start and by the unit tests). Precedence, lowest first:
defaults, the YAML file (`--config`), environment (`GPU_AGENT_<NAME>`), flags. Every
value is checked once, at start; a bad one raises `ConfigError` naming the setting, where
it came from and the accepted range, and the CLI exits with code 2. Secrets are read from
the environment or a file only (a flag would show in `ps`), and print as `<redacted>`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar, get_type_hints, overload
from urllib.parse import urlparse

import yaml

from gpu_agent.foundations.completion import COMPLETIONS
from gpu_agent.foundations.klog import FORMATS, quote
from gpu_agent.foundations.secrets import Secret
from gpu_agent.foundations.work_pods import KEYS as WORK_POD_KEYS
from gpu_agent.foundations.work_pods import parse_work_pods
from gpu_agent.foundations.xids import MAX_XID, parse_xids

_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def parse_labels(text: str) -> dict[str, str]:
    """`key=value,key2=value2` (an equality label selector, as `kubectl get -l` takes it) as a dict; ValueError
    naming the part that is not a Kubernetes label."""
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        prefix, slash, name = key.strip().rpartition("/")
        value = value.strip()
        if (not sep or not _LABEL_NAME.fullmatch(name) or (slash and not _DNS_SUBDOMAIN.fullmatch(prefix))
                or (value and not _LABEL_NAME.fullmatch(value))):
            raise ValueError(f"{part!r} is not key=value with a Kubernetes label key and value")
        labels[key.strip()] = value
    return labels


def labels_text(labels: dict[str, str]) -> str:
    """The canonical `key=value,...` of a label set (sorted keys): a label selector the API server takes."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))

ENV_PREFIX = "GPU_AGENT_"

# Feature gates and their defaults; `--feature-gates=Name=true,Other=false` overrides them.
FEATURE_GATES = {
    "LongPollLeases": True,  # the work queue is long-polled instead of polled every queuePollInterval
}


class ConfigError(Exception):
    pass


MAX_CONFIG_BYTES = 1 << 20


def quote_one_line(value: object, limit: int = 200) -> str:
    return quote(str(value)[:limit])


def _snake(name: str) -> str:
    """camelCase as snake_case, an acronym kept whole: gpuPollInterval -> gpu_poll_interval, gracefulNoGPU ->
    graceful_no_gpu (its flag --graceful-no-gpu, its variable GPU_AGENT_GRACEFUL_NO_GPU)."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


@dataclass(frozen=True)
class Setting:
    name: str  # camelCase, as in YAML and the chart's values
    kind: str  # "seconds" | "number" | "int" | "str" | "bool" | "choice" | "url" | "address" | "path" | "secret" | "xids" | "labels"
    # | "workPods" (foundations/work_pods.py: a mapping in a config file, JSON in a flag or the environment)
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()
    optional: bool = False  # str/path/url may be empty

    @property
    def flag(self) -> str:
        if self.name == "verbosity":
            return "-v"
        return "--" + _snake(self.name).replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + _snake(self.name).upper()

    def describe_range(self) -> str:
        if self.kind in ("seconds", "int", "number"):
            unit = " seconds" if self.kind == "seconds" else ""
            return f"a number{unit} between {self.min:g} and {self.max:g}"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "bool":
            return "true or false"
        if self.kind == "url":
            return "an http:// or https:// URL"
        if self.kind == "featureGates":
            return "comma-separated Name=true|false with Name one of " + ", ".join(sorted(FEATURE_GATES))
        if self.kind == "address":
            return "HOST:PORT with a port between 0 and 65535"
        if self.kind == "xids":
            return f"Xid numbers between 1 and {MAX_XID}, comma-separated (a list in a config file), e.g. 13,31,43; empty for none"
        if self.kind == "labels":
            return ("node labels as key=value pairs, comma-separated (a mapping in a config file), e.g. "
                    "pool=a100,kubernetes.io/os=linux; empty for none")
        if self.kind == "workPods":
            return ("a mapping (JSON in a flag or the environment) of " + ", ".join(WORK_POD_KEYS)
                    + ", as a Pod spec has them (the chart's workPods values); {} for none")
        return "a non-empty string"

    def convert(self, raw: Any, origin: str) -> Any:
        def bad() -> ConfigError:
            try:
                shown = "<redacted>" if self.kind == "secret" else quote_one_line(repr(raw))
            except RecursionError:
                shown = f"a {type(raw).__name__} nested too deeply"
            return ConfigError(f"invalid value for {self.name} (from {origin}): must be {self.describe_range()}, "
                               f"got {shown}; set it with {self.flag} or {self.env}")

        if self.kind == "secret":
            return Secret(str(raw).strip())
        if self.kind in ("seconds", "int", "number"):
            if isinstance(raw, bool):
                raise bad()
            try:
                value: Any = int(str(raw), 10) if self.kind == "int" else float(raw)
            except (TypeError, ValueError):
                raise bad() from None
            if value != value or not (self.min <= value <= self.max):  # NaN fails too
                raise bad()
            return value
        if self.kind == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("true", "1", "yes", "on"):
                return True
            if text in ("false", "0", "no", "off"):
                return False
            raise bad()
        if self.kind == "xids":
            if isinstance(raw, (list, tuple)):  # a YAML list in a config file
                if not all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
                    raise bad()
                raw = ",".join(str(x) for x in raw)
            if isinstance(raw, int) and not isinstance(raw, bool):  # one Xid in a config file
                raw = str(raw)
            if not isinstance(raw, str):
                raise bad()
            try:
                return parse_xids(raw)
            except ValueError:
                raise bad() from None
        if self.kind == "labels":
            if isinstance(raw, dict):  # a YAML mapping in a config file
                if not all(isinstance(k, str) and isinstance(v, (str, int)) and not isinstance(v, bool)
                           for k, v in raw.items()):
                    raise bad()
                raw = ",".join(f"{k}={v}" for k, v in raw.items())
            if raw is None:
                raw = ""
            if not isinstance(raw, str):
                raise bad()
            try:
                return labels_text(parse_labels(raw))
            except ValueError:
                raise bad() from None
        if self.kind == "workPods":
            if isinstance(raw, str) and raw.strip():  # a flag or the environment: JSON
                try:
                    raw = json.loads(raw)
                except (ValueError, RecursionError):
                    raise bad() from None
            try:
                return parse_work_pods(raw)
            except (ValueError, RecursionError) as e:
                raise ConfigError(f"invalid value for {self.name} (from {origin}): {quote_one_line(e, 400)}; fix it in "
                                  f"the chart's workPods values, or the config file's {self.name} (JSON in {self.flag} "
                                  f"or {self.env})") from None
        if isinstance(raw, (dict, list, tuple, set)):
            raise bad()  # a structure where one value belongs (from a config file)
        text = "" if raw is None else str(raw)
        if self.kind == "featureGates":
            gates = dict(FEATURE_GATES)
            for part in filter(None, (p.strip() for p in text.split(","))):
                name, sep, value = part.partition("=")
                if not sep or name not in FEATURE_GATES or value.lower() not in ("true", "false"):
                    raise bad()
                gates[name] = value.lower() == "true"
            return gates
        if not text:
            if self.optional:
                return ""
            raise bad()
        if self.kind == "choice" and text not in self.choices:
            raise bad()
        if self.kind == "url":
            u = urlparse(text)
            if u.scheme not in ("http", "https") or not u.netloc:
                raise bad()
            return text.rstrip("/")
        if self.kind == "address":
            _host, sep, port = text.rpartition(":")
            if not sep or not port.isdigit() or int(port) > 65535:
                raise bad()
        return text


# The type a setting of each kind holds once loaded (an optional number is "" while unset).
KIND_TYPES: dict[str, object] = {
    "seconds": float, "number": float, "int": int, "bool": bool, "secret": Secret, "featureGates": dict[str, bool],
    "str": str, "path": str, "url": str, "address": str, "choice": str, "xids": tuple[int, ...], "labels": str,
    "workPods": dict[str, Any],
}


def setting_type(s: Setting) -> object:
    if s.optional and s.kind in ("seconds", "number", "int"):
        return KIND_TYPES[s.kind] | str
    return KIND_TYPES[s.kind]


class Config:
    """Attribute access over validated settings; secrets stay `Secret`. A role's subclass declares its
    settings' types (annotations only: the values live in `_values`)."""

    # Attributes a role sets itself (with `replace`) that are not settings of its table.
    DERIVED: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: list[Setting], values: dict[str, Any],
                 from_files: frozenset[str] = frozenset()) -> None:
        self._settings = {s.name: s for s in settings}
        self._values = values
        self._from_files = from_files  # the secrets `load` read from their companion *File setting

    if not TYPE_CHECKING:  # to mypy a setting is what the subclass declares, never an untyped attribute
        def __getattr__(self, name: str) -> Any:
            try:
                return self._values[name]
            except KeyError:
                raise AttributeError(name) from None

    def replace(self, **changes: object) -> Self:
        return type(self)(list(self._settings.values()), {**self._values, **changes}, self._from_files - changes.keys())

    def secret_file(self, name: str) -> str:
        """The file secret `name` was read from (its companion setting `<name>File`), or "" when it came from the
        environment, or was set by the role itself: a token that may change under a running process is read
        again from there (foundations/token_file.py)."""
        return str(self._values.get(name + "File") or "") if name in self._from_files else ""

    @classmethod
    def problems(cls, settings: list[Setting]) -> list[str]:
        """How this class's declarations differ from `settings` (empty when they agree)."""
        declared = {name: hint for name, hint in get_type_hints(cls).items() if not name.startswith("_")
                    and name != "DERIVED"}
        out = []
        for s in settings:
            if s.name not in declared:
                out.append(f"{cls.__name__} does not declare setting {s.name}")
            elif declared[s.name] != setting_type(s):
                out.append(f"{cls.__name__}.{s.name} is declared {declared[s.name]}, but a {s.kind} setting holds "
                           f"{setting_type(s)}")
        names = {s.name for s in settings}
        out += [f"{cls.__name__} declares {name}, which is no setting of its table"
                for name in sorted(set(declared) - names - cls.DERIVED)]
        return out

    def describe(self) -> list[str]:
        """The effective configuration as readable `name: value` lines, secrets redacted."""
        out = []
        for name, value in self.redacted().items():
            shown = json.dumps(value) if isinstance(value, (dict, list, tuple)) or value == "" else value
            out.append(f"{name}: {shown}")
        return out

    def redacted(self) -> dict[str, Any]:
        out = {}
        for name, value in sorted(self._values.items()):
            if isinstance(value, Secret):
                out[name] = "<redacted>" if value else "<unset>"
            else:
                out[name] = value
        return out


def _help_default(s: Setting) -> str:
    if s.kind == "featureGates":
        return ",".join(f"{k}={str(v).lower()}" for k, v in sorted(FEATURE_GATES.items()))
    if s.kind == "xids":
        return ",".join(str(x) for x in s.default) or "none"
    if s.default in ("", None, {}):
        return "unset"
    if isinstance(s.default, bool):
        return str(s.default).lower()
    if isinstance(s.default, float):
        return f"{s.default:g}" + ("s" if s.kind == "seconds" else "")
    return str(s.default)


def add_arguments(parser: argparse.ArgumentParser, settings: list[Setting]) -> None:
    """One flag per setting; its help gives the meaning, the default and the environment variable.
    argparse treats `%` in help as a format character, hence the escaping."""
    parser.add_argument("--config", metavar="FILE", help="YAML file of settings (camelCase keys); "
                        "environment and flags override it")
    secrets = []
    for s in settings:
        text = s.help.replace("%", "%%")
        if s.kind == "secret":
            secrets.append(s)  # from the environment or a *File setting only
            continue
        if s.name == "verbosity":
            parser.add_argument("-v", "--v", dest=s.name, metavar="N", help=f"{text} (default: 0; env {s.env})")
            continue
        default = _help_default(s).replace("%", "%%")
        action = parser.add_argument(s.flag, dest=s.name, metavar=s.kind.upper(),
                                     help=f"{text} (default: {default}; env {s.env})")
        if s.kind in ("choice", "bool"):  # offered by shell completion; checked by load, which names the setting
            setattr(action, COMPLETIONS, s.choices if s.kind == "choice" else ("true", "false"))
    if secrets:
        # An epilog is not %-formatted (only help strings are).
        parser.epilog = ("Secrets are never flags; set them in the environment (or the matching *File setting): "
                         + "; ".join(f"{s.env} ({s.help})" for s in settings if s.kind == "secret"))


C = TypeVar("C", bound=Config)


@overload
def load(settings: list[Setting], args: argparse.Namespace, environ: dict[str, str] | None = None) -> Config: ...
@overload
def load(settings: list[Setting], args: argparse.Namespace, environ: dict[str, str] | None = None, *,
         as_: type[C]) -> C: ...
def load(settings: list[Setting], args: argparse.Namespace, environ: dict[str, str] | None = None, *,
         as_: type[Config] = Config) -> Config:
    """The settings from the config file, the environment and `args`, as an `as_`."""
    if as_ is not Config and (problems := as_.problems(settings)):
        raise TypeError("; ".join(problems))
    environ = dict(os.environ if environ is None else environ)
    by_name = {s.name: s for s in settings}
    raw: dict[str, tuple[Any, str]] = {}
    config_file = getattr(args, "config", None)
    if config_file:
        try:
            raw_bytes = Path(config_file).read_bytes()
            if len(raw_bytes) > MAX_CONFIG_BYTES:
                raise ConfigError(f"config file {config_file} is larger than {MAX_CONFIG_BYTES} bytes; "
                                  "it holds a few settings")
            doc = yaml.safe_load(raw_bytes.decode("utf-8")) or {}
        except OSError as e:
            raise ConfigError(f"config file {config_file} cannot be read: {e.strerror}; point --config at a "
                              "readable YAML file") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {config_file} is not UTF-8 text (byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {config_file} is not valid YAML: {quote_one_line(e)}") from None
        except (RecursionError, ValueError) as e:
            raise ConfigError(f"config file {config_file} is not usable YAML ({type(e).__name__})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"config file {config_file} must hold a mapping of setting names to values")
        for key, value in doc.items():
            if not isinstance(key, str) or key not in by_name:
                raise ConfigError(f"unknown setting {quote_one_line(key)!r} in config file {config_file}; "
                                  f"known settings: {', '.join(sorted(by_name))}")
            if by_name[key].kind == "secret":
                raise ConfigError(f"setting {key!r} is a secret and cannot be set in a config file; "
                                  f"use {by_name[key].env} or {key}File")
            raw[key] = (value, f"config file {config_file}")
    for s in settings:
        if s.env in environ:
            raw[s.name] = (environ[s.env], f"environment {s.env}")
        flag_value = getattr(args, s.name, None)
        if flag_value is not None:
            raw[s.name] = (flag_value, f"flag {'-v' if s.name == 'verbosity' else s.flag}")
    values: dict[str, Any] = {}
    for s in settings:
        if s.name in raw:
            value, origin = raw[s.name]
            values[s.name] = s.convert(value, origin)
        else:
            if s.kind == "secret":
                values[s.name] = Secret(s.default or "")
            elif s.kind == "featureGates":
                values[s.name] = s.convert(s.default, "default")
            else:
                values[s.name] = s.default
    # A secret may also come from a file named by its companion setting, e.g. controlPlaneTokenFile.
    from_files = set()
    for s in settings:
        if s.kind != "secret" or values[s.name]:
            continue
        file_setting = values.get(s.name + "File")
        if file_setting:
            try:
                values[s.name] = Secret(Path(file_setting).read_text().strip())
                from_files.add(s.name)
            except OSError as e:
                raise ConfigError(f"invalid value for {s.name}File: {file_setting} cannot be read "
                                  f"({e.strerror}); point {by_name[s.name + 'File'].flag} at a readable file") from None
    return as_(settings, values, frozenset(from_files))


VERBOSITY = Setting("verbosity", "int", 0, "log verbosity, 0 (quiet) to 7 (every detail)", 0, 7)
LOG_FORMAT = Setting("logFormat", "choice", "text", "log line format: text (klog's `I1129 22:43:40.123456 12345 "
                     "file.py:42] msg`) or json (one JSON object a line: ts, level, v, logger, caller, msg, pid, "
                     "thread, err), secrets redacted in both", choices=FORMATS)
# The settings every command's table starts with: how it logs.
LOGGING = [VERBOSITY, LOG_FORMAT]


class RoleConfig(Config):
    """What every command's settings have (their tables start with LOGGING)."""
    verbosity: int
    logFormat: str
