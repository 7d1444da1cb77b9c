"""The ``pyproject.toml`` of a Flower App written for a run on a real deployment.

``flwr run <folder>`` reads the App's components and run-config defaults from this
file (Flower's "Configure pyproject.toml" page,
https://flower.ai/docs/framework/how-to-configure-pyproject-toml.html).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

UserValue = str | int | float | bool
"""A run-config value as Flower's ``UserConfigValue`` allows it."""


def write_pyproject(
    app_dir: Path,
    name: str,
    serverapp: str,
    clientapp: str,
    config: Mapping[str, UserValue],
    description: str | None = None,
) -> Path:
    """``app_dir/pyproject.toml`` of the Flower App ``name``.

    ``serverapp`` and ``clientapp`` are the components' ``module:object``;
    ``config`` becomes the run config's defaults (``[tool.flwr.app.config]``);
    ``description``, if given, the project's description. Returns the file.
    """
    lines = [
        "[build-system]",
        'requires = ["hatchling"]',
        'build-backend = "hatchling.build"',
        "",
        "[project]",
        f'name = "{name}"',
        'version = "1.0.0"',
        *([] if description is None else [f'description = "{description}"']),
        'license = "Apache-2.0"',
        "dependencies = []",
        "",
        "[tool.hatch.build.targets.wheel]",
        'packages = ["."]',
        "",
        "[tool.flwr.app]",
        'publisher = "flowerbed"',
        "",
        "[tool.flwr.app.components]",
        f'serverapp = "{serverapp}"',
        f'clientapp = "{clientapp}"',
        "",
        "[tool.flwr.app.config]",
        *(f"{key} = {toml_value(value)}" for key, value in config.items()),
    ]
    path = app_dir / "pyproject.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def toml_value(value: UserValue) -> str:
    """A TOML value: booleans lower-case, strings quoted (JSON's escapes are
    TOML's), numbers as Python writes them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)
