"""MkDocs hook: the CLI and run-config reference, generated from the code.

``docs/reference/run-config.md`` holds the marker ``<!-- run-config-keys -->`` and
``docs/reference/cli.md`` the marker ``<!-- fmtl-help -->``; :func:`on_page_markdown` replaces
them with

* one table per namespace (common keys, ``mocha.*``, ``fedem.*``, ``ofmtl.*``, ``fsvrg.*``) of
  every key of :class:`fmtl_flower.config.RunConfig`: its default on the wire, the settings
  fields that take it, and its meaning, read from the numpy docstrings (``Attributes``) of
  the settings dataclasses (:mod:`fmtl_flower.settings`) and of the run config's own keys;
* the ``--help`` of ``fmtl``, ``fmtl run`` and ``fmtl reproduce`` (the argparse parser).

Nothing is copied by hand: a key, default or docstring changed in the code changes the page.
``python docs/hooks/reference.py`` prints the run-config tables.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the checkout's package, installed or not
    sys.path.insert(0, str(ROOT))

from fmtl_flower import config, settings  # noqa: E402

KEYS_MARKER = "<!-- run-config-keys -->"
HELP_MARKER = "<!-- fmtl-help -->"
#: The classes whose docstrings describe run-config keys, most specific first.
DOCUMENTED = (settings.RunKeys, settings.CommonSettings, settings._PrimalDualSettings,
              settings.MOCHASettings, settings.MbSGDSettings, settings.FedEMSettings,
              settings.OFMTLSettings, settings.FSVRGSettings, settings.DPSettings)
SETTINGS = settings.SETTINGS_CLASSES[1:]  # the families' (each extends CommonSettings)
_ENTRY = re.compile(r"^    (?P<names>[A-Za-z_][\w, ]*?)(?: : (?P<type>.*))?$")
_ROLE = re.compile(r":(?:mod|class|func|meth|data|attr):`~?([^`]+)`")
#: The namespaces in the order of the page ("" the common keys).
ORDER = ("", "mocha", "fedem", "ofmtl", "fsvrg", "dp")


def attributes(cls: type) -> dict[str, str]:
    """Field name -> description, from the ``Attributes`` section of ``cls``' own numpy
    docstring (an entry ``a, b : type`` describes both fields)."""
    doc = cls.__dict__.get("__doc__") or ""
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip().startswith("Attributes"))
    except StopIteration:
        return {}
    out: dict[str, str] = {}
    names: list[str] = []
    text: list[str] = []

    def flush() -> None:
        for name in names:
            out[name] = " ".join(text)

    for line in lines[start + 2:]:
        match = _ENTRY.match(line)
        if match and not line.startswith("     "):
            flush()
            names = [n.strip() for n in match["names"].split(",")]
            text = []
        elif line.startswith("        "):
            text.append(line.strip())
        elif line.strip():
            break
    flush()
    return out


def meaning(field_name: str, owners: list[type]) -> str:
    """The docstring description of ``field_name`` in the first class that documents it,
    as Markdown (reST's double backticks and roles as code spans)."""
    for cls in owners:
        for doc_cls in cls.__mro__:
            found = attributes(doc_cls).get(field_name) if doc_cls in DOCUMENTED else None
            if found:
                return _ROLE.sub(r"`\1`", found.replace("``", "`"))
    return ""


def key_rows() -> dict[str, list[tuple[str, str, str, str]]]:
    """Per namespace ("" common), one row per key: key, wire default, settings fields,
    meaning."""
    defaults = config.RunConfig()
    own = {f.name for f in dataclasses.fields(settings.RunKeys)}
    rows: dict[str, list[tuple[str, str, str, str]]] = {n: [] for n in ORDER}
    for f in dataclasses.fields(config.RunConfig):
        key = f.metadata["key"]
        takers = [(cls, g) for cls in SETTINGS for g in dataclasses.fields(cls)
                  if g.metadata["key"] == key]
        fields = sorted({f"`{cls.__name__}.{g.name}`" for cls, g in takers})
        if f.name in own:  # a key of the run config itself: its docstring first
            text = meaning(f.name, [settings.RunKeys])
        else:
            text = meaning(takers[0][1].name, [cls for cls, _ in takers])
        namespace = key.partition(".")[0] if "." in key else ""
        rows[namespace].append(
            (f"`{key}`", _default(getattr(defaults, f.name)), ", ".join(fields) or "run config",
             text.replace("|", "\\|")))
    return rows


def _default(value: Any) -> str:
    """A default as the run config writes it (``""``, ``true``)."""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return '`""`' if value == "" else f"`{value}`"


def run_config_tables() -> str:
    """The run-config keys as Markdown tables, one per namespace."""
    parts = []
    for namespace, rows in key_rows().items():
        if namespace:
            label = config.NAMESPACES[namespace][1]
            parts.append(f"### `{namespace}.*`\n\nRead by {label}.\n")
        else:
            parts.append("### Common keys\n\nRead by every strategy.\n")
        parts.append("| key | default | setting | meaning |\n|---|---|---|---|")
        parts.extend(f"| {' | '.join(row)} |" for row in rows)
        parts.append("")
    return "\n".join(parts)


def cli_help() -> str:
    """``fmtl --help`` and each subcommand's, as text blocks."""
    from fmtl_flower.cli import build_parser

    parser = build_parser()
    parts = [("fmtl", parser)]
    for action in parser._subparsers._group_actions:  # argparse has no public accessor
        parts.extend((f"fmtl {name}", sub) for name, sub in action.choices.items())
    return "\n".join(f"### `{name}`\n\n```text\n{sub.format_help().rstrip()}\n```\n"
                     for name, sub in parts)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """MkDocs' hook: fill the markers of the reference pages."""
    if KEYS_MARKER in markdown:
        markdown = markdown.replace(KEYS_MARKER, run_config_tables())
    if HELP_MARKER in markdown:
        markdown = markdown.replace(HELP_MARKER, cli_help())
    return markdown


if __name__ == "__main__":
    print(run_config_tables())
