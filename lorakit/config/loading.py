"""Assembling a config: YAML read safely, layers merged (defaults < profile < YAML < --set), every problem reported
at once with its key path and the value received; the resolved config written back as YAML."""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lorakit.config.schema import Config
from lorakit.errors import ConfigError
from lorakit.hardware import profiles as prof


def deep_merge(base: dict, over: dict) -> dict:
    """Merge `over` into a copy of `base`; nested dicts merge, everything else replaces."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would silently keep the last)."""


def _strict_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1}): which one is meant?",
                key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _strict_mapping)


# What a run config may hold. A real one is a few KB with a handful of levels; these stop a file that would take
# minutes or gigabytes to read (YAML aliases expand: ten anchors, each nine times the one before, are 3.5e9 values)
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 100_000  # values after every alias is expanded


def _check_shape(text: str, source: str) -> None:
    """Refuse YAML whose nesting or expanded size is past the limits, from its event stream (the parser is a
    state machine: nothing here recurses or expands)."""
    open_ = [[0, None]]  # per open collection: [values in it so far, its anchor]
    anchors: dict[str, int] = {}  # anchor -> values of the node it names
    total = 0
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        n = 0
        if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            open_.append([0, ev.anchor])
            if len(open_) - 1 > MAX_YAML_DEPTH:
                raise ConfigError([f"nested more than {MAX_YAML_DEPTH} levels deep (at line {ev.start_mark.line + 1})"],
                                  source=source, hint="a run config has a few levels of sections; is this the "
                                                      "right file?")
        elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            inner, anchor = open_.pop()
            n = inner + 1
            if anchor:
                anchors[anchor] = n
        elif isinstance(ev, yaml.ScalarEvent):
            n = 1
            if ev.anchor:
                anchors[ev.anchor] = 1
        elif isinstance(ev, yaml.AliasEvent):
            n = anchors.get(ev.anchor, 1)
            total += n  # an alias's values are new values
        open_[-1][0] += n
        if total > MAX_YAML_NODES or open_[0][0] > MAX_YAML_NODES or open_[-1][0] > MAX_YAML_NODES:
            raise ConfigError([f"more than {MAX_YAML_NODES:,} values once its aliases (*name) are expanded"],
                              source=source, hint="a run config holds a few hundred values; remove the aliases "
                                                  "that repeat others")


def parse_yaml(text: str, source: str) -> object:
    """YAML text -> data, duplicate keys refused, size, nesting and alias expansion limited; errors name the line.

    Raises:
        ConfigError: a syntax error, a duplicate key, or text past the limits.
    """
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError([f"{len(text) / 2**20:.1f} MB of YAML; a run config is a few KB (at most "
                           f"{MAX_YAML_BYTES >> 20} MB)"], source=source, hint="is this the right file?")
    try:
        _check_shape(text, source)
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"YAML error{where}: {getattr(e, 'problem', None) or e}"], source=source,
                          hint="YAML wants `key: value` with a space after the colon, nesting by indentation "
                               "(spaces, not tabs), and each key once per section") from None


def load_yaml(path: Path) -> dict:
    """Read a YAML mapping.

    Raises:
        ConfigError: missing file, a folder, not UTF-8, YAML syntax error or duplicate key, or not a mapping.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError([f"{path} is a folder, not a config file"],
                          hint="give the YAML file, e.g. my-run.yaml (`lorakit demo` writes an example config.yaml)")
    if not path.is_file():
        why = "file not found" if not path.exists() else "not a regular file"
        raise ConfigError([f"{why}: {path}"], hint="check the path, or run `lorakit demo` for an example")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path} is not UTF-8 text (byte {e.start} cannot be read)"],
                          hint="save the config as UTF-8") from None
    data = parse_yaml(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping of sections, got {type(data).__name__}"],
                          source=str(path))
    return data


_SCI = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def parse_overrides(items: list[str]) -> tuple[dict, list[str]]:
    """Turn `a.b=c` strings into a nested dict; values are parsed as YAML (numbers, lists, null).

    Returns:
        (overrides, problems) — problems are reported together with validation errors.
    """
    out: dict = {}
    problems: list[str] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"--set {item!r}: expected key.path=value, e.g. --set lora.rank=32")
            continue
        try:
            value = parse_yaml(raw, f"--set {key}") if raw.strip() else ""
        except ConfigError as e:
            if "YAML error" not in e.message:  # past the limits: said as it is
                problems.append(f"--set {key}: {e.problems[0]}")
                continue
            value = raw
        if isinstance(value, str) and _SCI.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 2e-4 as a string
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                problems.append(f"--set {item!r}: {p} was already set to a value")
                break
            node = nxt
        else:
            node[parts[-1]] = value
    return out, problems


def _fields_at(loc: tuple) -> list[str]:
    """Field names valid at a location in the tree (for 'did you mean')."""
    model: Any = Config
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


MOVED = {"sampling.validation_items": "validation.items", "sampling.validation_every": "validation.every"}


def _format_error(err: dict) -> str:
    loc = tuple(str(p) for p in err["loc"])
    path = ".".join(loc) or "(top level)"
    kind = err["type"]
    if not loc and kind == "value_error":  # checks across sections: each line names its keys
        return err["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden" and path in MOVED:
        return f"{path}: moved to {MOVED[path]}"
    if kind == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        close = difflib.get_close_matches(loc[-1], valid, n=1)
        tip = f" (did you mean {close[0]!r}?)" if close else (f" (valid: {', '.join(valid)})" if valid else "")
        return f"{path}: unknown key{tip}"
    if kind == "missing":
        return f"{path}: required but missing"
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    got = err.get("input")
    if isinstance(got, dict):
        return f"{path}: {msg}"
    shown = repr(got)
    if len(shown) > 80:  # a value as long as a file says nothing more in full
        shown = f"{shown[:60]}… ({len(got) if hasattr(got, '__len__') else len(shown)} long)"
    return f"{path}: {msg}, got {shown}"


def validate(data: dict, source: str | None = None, extra_problems: list[str] | None = None) -> Config:
    """Validate a merged dict; all problems (plus `extra_problems`) go into one ConfigError."""
    problems = list(extra_problems or [])
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        problems += [line for err in e.errors() for line in _format_error(err).split("\n")]
        cfg = None
    if problems:
        raise ConfigError(problems, source=source,
                          hint="see `docs/configuration.md`; `lorakit train CONFIG --dry-run` checks a config")
    return cfg


def _from_sets(e: ConfigError, overrides: list[str], source: str | None) -> ConfigError:
    """The same problems, each one a --set gave said so (`--set lora.rank=0`), and the source named as the file
    and/or --set they come from."""
    given = {}
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key:
            given[key] = item
    problems, from_sets = [], 0
    for text in e.problems:
        key = text.split(":", 1)[0].strip()
        hit = next((item for k, item in given.items() if key == k or key.startswith(k + ".") or text.startswith(
            f"--set {k}")), None)
        if hit is not None:
            from_sets += 1
            problems.append(text if text.startswith("--set") else f"{text} (--set {hit})")
        else:
            problems.append(text)
    if from_sets == len(problems):
        where = "the --set values"
    elif from_sets:
        where = f"{source} and the --set values" if source else "the --set values"
    else:
        where = source
    return ConfigError(problems, source=where, hint=e.hint)


def assemble(config_path: Path | dict | None = None, overrides: list[str] | None = None,
             profile: str | None = None, probe_facts: Any = None, before_probe: Any = None) -> tuple[Config, dict]:
    """The run's config from its layers: defaults < profile < YAML < --set (every problem at once).

    Args:
        config_path: the user's YAML (optional), or its contents already read (a dict).
        overrides: `key.path=value` strings.
        profile: a profile name or "auto"; beats `profile:` in the YAML.
        probe_facts: hardware facts for `auto` (probed when None).
        before_probe: called with the user's layers (YAML < --set, checked) and the profile name asked for, before
            the machine is probed (which imports torch): what a run starts as soon as its config is read.

    Returns:
        (config, provenance) where provenance says which profile was used and why.
    """
    user = dict(config_path) if isinstance(config_path, dict) else load_yaml(config_path) if config_path else {}
    sets, problems = parse_overrides(overrides or [])
    layered = deep_merge(user, sets)
    name = profile or layered.get("profile") or "auto"
    if not isinstance(name, str):
        problems.append(f"profile: must be a profile name, got {name!r}")
        name = "auto"
    source = str(config_path) if config_path and not isinstance(config_path, dict) else None
    # The user's own layer is checked first: its mistakes are reported without probing the machine
    # (which imports torch). Profiles only supply defaults, so they cannot mend a user mistake.
    try:
        validate({k: v for k, v in layered.items() if k != "profile"}, source=source, extra_problems=problems)
    except ConfigError as e:
        raise _from_sets(e, overrides or [], source) from None
    if before_probe:
        before_probe(layered, name)
    choice = prof.choose(name, probe_facts)
    merged = deep_merge(choice.profile.defaults, layered)
    merged["profile"] = choice.profile.name
    cfg = validate(merged, source=source)
    return cfg, {"profile": choice.profile.name, "reason": choice.reason, "warnings": choice.warnings}


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what --dry-run prints and what runs save)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)
