"""Pieces of a Flower deployment on 127.0.0.1: the App's ``pyproject.toml``, the
connection the ``flwr`` CLI uses, the SuperLink's and the SuperNodes' commands.

The span deployment bench (:mod:`flowerbed.bench.span_deployment`) and the test
harness (``tests/procs.py``) start their deployments with these. ``flwr run
<folder>`` reads the App's components and run-config defaults from its
``pyproject.toml`` (Flower's "Configure pyproject.toml" page,
https://flower.ai/docs/framework/how-to-configure-pyproject-toml.html).
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

HOST = "127.0.0.1"

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def program(name: str) -> str:
    """Path of a Flower console script of the running Python environment."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found beside {sys.executable} or on PATH")
    return found


def format_user_config(values: Mapping[str, UserValue]) -> str:
    """``{"a": "x", "n": 2}`` -> ``a="x" n=2``, the syntax of ``--node-config``."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            if '"' in value or " " in value:
                raise ValueError(f"config value {value!r} may not hold quotes/spaces")
            text = f'"{value}"'
        else:
            text = repr(value)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def connection_toml(connection: str, superlink_port: int, options: str = "") -> str:
    """The ``config.toml`` of a ``FLWR_HOME`` whose default connection
    ``connection`` reaches the SuperLink on ``127.0.0.1:superlink_port``
    (insecure); ``options`` (TOML lines) end the connection's table."""
    return (
        "[superlink]\n"
        f'default = "{connection}"\n\n'
        f"[superlink.{connection}]\n"
        f'address = "{HOST}:{superlink_port}"\n'
        "insecure = true\n" + options
    )


def superlink_command(port: int) -> list[str]:
    """``flower-superlink``, insecure, its Runtime HTTP API (``/health``, the
    ``flwr`` CLI's address) on ``127.0.0.1:port``, installing no App
    dependencies."""
    return [
        program("flower-superlink"),
        "--insecure",
        "--host",
        HOST,
        "--port",
        str(port),
        "--disable-runtime-dependency-installation",
    ]


def supernode_command(
    superlink_port: int, node_config: Mapping[str, UserValue]
) -> list[str]:
    """``flower-supernode``, insecure, connecting to the SuperLink on
    ``127.0.0.1:superlink_port``, its own Runtime HTTP API on a free port, with
    ``node_config`` (``--node-config``, left out when empty)."""
    args = [
        program("flower-supernode"),
        "--insecure",
        "--superlink",
        f"{HOST}:{superlink_port}",
        "--host",
        HOST,
        "--port",
        str(free_port()),
    ]
    if node_config:
        args += ["--node-config", format_user_config(node_config)]
    return args
