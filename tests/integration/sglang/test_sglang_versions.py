"""sglang releases people still run (0.5.20-0.5.22), from their real wheels.

Each release's wheel is downloaded here (never installed: its `sglang/` is unpacked
into a temporary folder that a subprocess puts first on PYTHONPATH, beside this
environment's dependencies). There the plugin must hook exactly the targets whose code
is sglang 0.5.23's, which its hooks mirror, leave every other to sglang with one
WARNING naming the version and each target, and `gpu-planner info` must say the same.
Where it hooks, the hooked calls must do what that release's own code does.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import pkgutil
import subprocess
import sys
import zipfile

import pytest
import tomllib
from packaging.specifiers import SpecifierSet

from gpu_planner.integration.sglang import plugin
from gpu_planner.integration.sglang.sglang_sources import (
    MIRRORED_SGLANG,
    SOURCE_FINGERPRINTS,
    SUPPORTED_SGLANG,
    source_fingerprint,
)

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[2]
OLDER_RELEASES = ("0.5.20", "0.5.21", "0.5.22")
# The test files whose hooks an older release keeps, run against that release's own code.
SERVED_CHECKS = {
    "0.5.20": ["test_pages_hook.py"],
    "0.5.21": ["test_pages_hook.py"],
    "0.5.22": ["test_pages_hook.py", "test_send_equivalence.py", "test_send_slice.py"],
}
SUBPROCESS_TIMEOUT_S = 900


def test_the_package_metadata_declares_the_supported_range():
    with open(ROOT / "pyproject.toml", "rb") as project:
        extras = tomllib.load(project)["project"]["optional-dependencies"]
    assert extras["sglang"] == [f"sglang{SUPPORTED_SGLANG}"]
    assert SpecifierSet(SUPPORTED_SGLANG).contains(MIRRORED_SGLANG)
    assert all(SpecifierSet(SUPPORTED_SGLANG).contains(v) for v in OLDER_RELEASES)


def test_every_hook_mirrors_the_installed_sglangs_code():
    """The fingerprints are the installed sglang 0.5.23's, for every hooked target."""
    targets = [record.target for record in plugin.hook_records()]
    assert sorted(SOURCE_FINGERPRINTS) == sorted(targets)
    for target in targets:
        found = source_fingerprint(pkgutil.resolve_name(target))
        assert found == SOURCE_FINGERPRINTS[target], f'    "{target}": "{found}",'


@pytest.fixture(scope="module")
def wheels(request, tmp_path_factory) -> pathlib.Path:
    """The older releases' wheels, downloaded once (kept in pytest's cache where it has one)."""
    cache = getattr(request.config, "cache", None)
    folder = (
        pathlib.Path(cache.mkdir("sglang-wheels"))
        if cache is not None
        else tmp_path_factory.mktemp("sglang-wheels")
    )
    for version in OLDER_RELEASES:
        if not list(folder.glob(f"sglang-{version}-*.whl")):
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
                + ["--only-binary=:all:", "--disable-pip-version-check"]
                + [f"sglang=={version}", "-d", str(folder)],
                check=True,
                timeout=SUBPROCESS_TIMEOUT_S,
            )
    return folder


@pytest.fixture(scope="module", params=OLDER_RELEASES)
def release(request, wheels, tmp_path_factory) -> tuple[str, pathlib.Path]:
    """(version, a folder holding that release's `sglang` package)."""
    version = request.param
    [wheel] = wheels.glob(f"sglang-{version}-*.whl")
    folder = tmp_path_factory.mktemp(f"sglang-{version}")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(folder, [n for n in archive.namelist() if n.startswith("sglang/")])
    return version, folder


def with_release(folder: pathlib.Path) -> dict:
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([str(folder), str(HERE)])
    environment.pop("GPU_PLANNER_DISABLE", None)
    environment.pop("SGLANG_PLUGINS", None)
    return environment


def function_code(root: pathlib.Path, target: str) -> str | None:
    """`target`'s definition in the sources under `root`, as Python's AST has it (docstring
    dropped), or None where it is not there: an independent reading of what code a release runs.
    """
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        path = root.joinpath(*parts[:split]).with_suffix(".py")
        if path.exists():
            break
    else:
        return None
    node: ast.AST = ast.parse(path.read_text())
    for name in parts[split:]:
        found = [
            child
            for child in ast.iter_child_nodes(node)
            if isinstance(child, ast.ClassDef | ast.FunctionDef) and child.name == name
        ]
        if not found:
            return None
        node = found[-1]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        node.body = body[1:]
    return ast.dump(node)


def installed_sglang() -> pathlib.Path:
    import sglang

    return pathlib.Path(sglang.__file__).parents[1]


def test_an_older_release_keeps_its_own_code_where_it_differs_and_says_so_once(release):
    version, folder = release
    probe = subprocess.run(
        [sys.executable, str(HERE / "sglang_version_probe.py")],
        env=with_release(folder),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        cwd=ROOT,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.splitlines()[-1])
    assert found["version"] == version
    assert found["file"].startswith(str(folder))
    records = plugin.hook_records()
    same_code = {
        r.target: function_code(folder, r.target) == function_code(installed_sglang(), r.target)
        for r in records
    }
    groups_out = {r.group for r in records if r.group and not same_code[r.target]}
    expected = {r.target for r in records if same_code[r.target] and r.group not in groups_out}
    assert set(found["hooked"]) == expected | {plugin.WARMUP_TARGET}
    left = [r.target for r in records if r.target not in expected]
    [warning] = found["warnings"]
    assert f"sglang {version} " in warning
    assert f"{len(left)} of {len(records)} targets run sglang's own code" in warning
    for target in left:
        assert f"{target} (" in warning
    assert warning.removeprefix("gpu_planner: ") in found["info"]
    # What the releases are known to differ in: 0.5.20 and 0.5.21 have another generic send
    # (no `dst_item_lens`, `bootstrap_room`), and no release before 0.5.23 has the decode's
    # receive-staging messages.
    assert (plugin.SEND_TARGET in expected) == (version == "0.5.22")
    assert plugin.REGISTRATION_MESSAGE_TARGET in left


def test_what_an_older_release_hooks_does_what_its_own_code_does(release):
    """The hooked sends and page conversion, checked against that release's originals by the
    same tests that check them against 0.5.23's."""
    version, folder = release
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
        + [str(HERE / name) for name in SERVED_CHECKS[version]],
        env=with_release(folder),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout.splitlines()[-1]
