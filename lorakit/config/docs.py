"""Render the configuration reference (docs/configuration.md) from the config models themselves."""

from __future__ import annotations

import json

from pydantic import BaseModel

from lorakit.config.schema import Config


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return json.dumps(value, default=str)


def render() -> str:
    """Markdown for every section and key: type, default, description."""
    lines = ["# Configuration reference", "",
             "Generated from `lorakit/config/` by `python -m lorakit.config.docs` — do not edit by hand.", "",
             "Precedence, lowest first: built-in defaults < hardware profile (`profiles/*.yaml`) < your YAML "
             "< `--set key.path=value`. Unknown keys are errors; every error is reported at once with its key path.",
             ""]
    top = [(n, f) for n, f in Config.model_fields.items() if not _is_section(f)]
    lines += ["## top level", "", "| key | default | description |", "|---|---|---|"]
    lines += [f"| `{n}` | `{_default(f)}` | {f.description or ''} |" for n, f in top]
    for name, field in Config.model_fields.items():
        if not _is_section(field):
            continue
        model = field.annotation
        lines += ["", f"## {name}", ""]
        if model.__doc__ and "Usage docs" not in model.__doc__:
            lines += [model.__doc__.strip(), ""]
        lines += ["| key | default | description |", "|---|---|---|"]
        for key, f in model.model_fields.items():
            lines.append(f"| `{name}.{key}` | `{_default(f)}` | {f.description or ''} |")
    return "\n".join(lines) + "\n"


def _is_section(field) -> bool:
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/configuration.md")
    target.write_text(render())
    print(f"wrote {target}")
