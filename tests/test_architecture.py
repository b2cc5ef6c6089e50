"""The layout of the package, pinned: one module per destination kind, the writer only speaks DCP,
and data flows down the layers without climbing back.

    integrations -> tools -> steps -> writer, reader, planner -> sharedreads -> reading
    -> stores -> io, session -> plan -> format

A module imports only from its own layer or the layers below (function-level imports count:
they are dependencies too); there is no import cycle; a trainer integration builds on the public
API, ``steps/``, the writer and the reader only, and imports its trainer in its own module alone;
``plan/`` and ``format/`` touch no file and import no fsspec; S3 requests are made only by the S3
store; no module is over 450 lines and ``writer.py`` is at most 400.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import hf_dcp_storage

PACKAGE = pathlib.Path(hf_dcp_storage.__file__).parent
LAYERS = {
    "format": 0,
    "plan": 1,
    "io": 2,
    "session": 2,
    "stores": 3,
    "reading": 4,
    "sharedreads": 5,
    "writer": 6,
    "reader": 6,
    "planner": 6,
    "steps": 7,
    "tools": 8,
    "__init__": 9,
    "__main__": 9,
    "integrations": 10,
}
# What the trainer integrations may build on, and the trainer package each one (alone) imports.
_INTEGRATION_BASES = {"__init__", "steps", "writer", "reader"}
_TRAINERS = {
    "integrations.torchtitan": "torchtitan",
    "integrations.lightning": "lightning",
    "integrations.peft": "peft",
    "integrations.torchtune": "torchtune",
    "integrations.accelerate": "accelerate",
    "integrations.accelerate_trainer": "accelerate",
}
MAX_LINES, MAX_WRITER_LINES = 450, 400
# The calls that send a request through s3fs's botocore client, and the module names that may.
_S3_CLIENT_CALLS = {"get_s3", "_call_s3", "set_session", "_get_s3_method_kwargs"}
_S3_MODULES = {"stores.s3", "stores.s3_requests"}


def _modules() -> dict[str, pathlib.Path]:
    """``dotted name inside the package -> file`` (``stores.s3``, ``writer``, ``format`` for its
    ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package modules ``name`` imports, anywhere in it (relative imports resolved)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
            target = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in modules else target)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("hf_dcp_storage.")
        ):
            found.add(node.module.removeprefix("hf_dcp_storage."))
    return {m for m in found if m in modules and m != name}


def _imported_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement names: each of ``import a, b.c``; the ``from`` module."""
    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def _layer(name: str) -> int:
    return LAYERS[name.split(".")[0]]


def test_every_module_is_in_a_layer() -> None:
    assert sorted(m for m in _modules() if m.split(".")[0] not in LAYERS) == []


def test_data_flows_down_the_layers() -> None:
    modules = _modules()
    climbing = sorted(
        f"{name} -> {dep}"
        for name, path in modules.items()
        for dep in _imports(name, path, modules)
        if _layer(dep) > _layer(name)
        or (_layer(dep) == _layer(name) and dep.split(".")[0] != name.split(".")[0])
    )
    assert climbing == [], (
        "a module imports from a layer above it (or a sibling at its own level): "
        + ", ".join(climbing)
    )


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path, node, dep]
            if dep not in state and (cycle := visit(dep, [*path, node])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name, [])
            assert cycle is None, " -> ".join(cycle[cycle.index(cycle[-1]) :])


def test_integrations_build_on_the_public_api_steps_writer_and_reader_only() -> None:
    modules = _modules()
    outside = sorted(
        f"{name} -> {dep}"
        for name, path in modules.items()
        if name.startswith("integrations.")
        for dep in _imports(name, path, modules)
        if dep.split(".")[0] not in _INTEGRATION_BASES
    )
    assert outside == [], (
        "an integration reaches past the public API, steps/, writer and reader: "
        + ", ".join(outside)
    )
    assert sorted(m for m in modules if m.startswith("integrations.")) == sorted(_TRAINERS)


def test_each_trainer_is_imported_by_its_integration_alone() -> None:
    offenders = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = _imported_names(node)
                offenders += [
                    f"{name}: imports {n}"
                    for n in names
                    if n.split(".")[0] in _TRAINERS.values()
                    and _TRAINERS.get(name) != n.split(".")[0]
                ]
    assert offenders == []


@pytest.mark.parametrize("module,trainer", sorted(_TRAINERS.items()))
def test_an_integration_without_its_trainer_says_how_to_install_it(
    module: str, trainer: str
) -> None:
    import subprocess
    import sys

    # In a fresh interpreter where the trainer cannot be imported (a None in sys.modules stops
    # its import), whether or not this venv has it.
    code = f"import sys; sys.modules[{trainer!r}] = None; import hf_dcp_storage.{module}"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0
    assert re.search(
        rf"ImportError: hf_dcp_storage\.{module} needs .*pip install 'hf_dcp_storage\[{trainer}\]'",
        done.stderr,
    ), done.stderr[-2000:]


def test_the_sizes_are_of_formatted_code() -> None:
    # The caps below count lines as ``ruff format`` (100 columns) leaves them, so they cannot be
    # met by wide lines. CI runs the formatter's check over the repository too (scripts/test.sh).
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which(
        "ruff"
    )
    assert ruff is not None, "ruff is missing: requirements-dev.txt installs it"
    done = subprocess.run(
        [ruff, "format", "--check", str(PACKAGE)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_module_sizes() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}
    assert sizes["writer"] <= MAX_WRITER_LINES, (
        f"writer.py has {sizes['writer']} lines; it speaks DCP, the stores do the rest"
    )


@pytest.mark.parametrize("package", ["plan", "format"])
def test_pure_packages_touch_no_file(package: str) -> None:
    offenders = []
    for name, path in _modules().items():
        if name.split(".")[0] != package:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = _imported_names(node)
                offenders += [
                    f"{name}: imports {n}"
                    for n in names
                    if n.split(".")[0] in ("fsspec", "os", "pathlib", "io", "shutil", "tempfile")
                ]
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "open"
            ):
                offenders.append(f"{name}: open() at line {node.lineno}")
    assert offenders == []


def test_s3_requests_only_in_the_s3_store() -> None:
    offenders = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in _S3_CLIENT_CALLS
                and name not in _S3_MODULES
            ):
                offenders.append(f"{name}:{node.lineno} .{node.attr}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = _imported_names(node)
                offenders += [
                    f"{name}: imports {n}"
                    for n in names
                    if n.split(".")[0] in ("s3fs", "botocore", "boto3", "aiobotocore")
                ]
    assert offenders == []


# What only stores/ may know: the backends' names and their filesystems' (a comparison with one
# of these outside stores/ is a backend branch), and the store modules other layers may import.
_BACKEND_WORDS = {
    "s3",
    "gcs",
    "gs",
    "azure",
    "az",
    "abfs",
    "direct",
    "staged",
    "s3fs",
    "gcsfs",
    "adlfs",
    "S3FileSystem",
    "GCSFileSystem",
    "AzureBlobFileSystem",
}
_STORES_SURFACE = {
    "stores",
    "stores.base",
    "stores.registry",
    "stores.ranks",
    "stores.coordinator",
    "stores.reads",
    "stores.retry",
}
# Error shapes of one SDK each (an S3 code, an Azure code, a botocore / azure.core class name),
# and the one module that may name each: the store's own requests.
_ERROR_SHAPES = {
    "SlowDown": "stores.s3_requests",
    "NoSuchUpload": "stores.s3_requests",
    "EndpointConnectionError": "stores.s3_requests",
    "BlobNotFound": "stores.azure_requests",
    "ServiceResponseError": "stores.azure_requests",
}


def _backend_branches(name: str, tree: ast.AST) -> list[str]:
    """Comparisons (``==``, ``in``, ``match`` cases) with a backend's name, and ``is_s3``-style
    calls."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found += [
                    f"{name}:{node.lineno} compares with {v.value!r}"
                    for v in values
                    if isinstance(v, ast.Constant) and v.value in _BACKEND_WORDS
                ]
        elif (
            isinstance(node, ast.match_case)
            and isinstance(node.pattern, ast.MatchValue)
            and isinstance(node.pattern.value, ast.Constant)
        ):
            if node.pattern.value.value in _BACKEND_WORDS:
                found.append(f"{name}: matches {node.pattern.value.value!r}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("is_")
            and node.attr[3:] in _BACKEND_WORDS
        ):
            found.append(f"{name}:{node.lineno} .{node.attr}")
    return found


def test_no_backend_branches_outside_stores() -> None:
    modules = _modules()
    branches, reaching = [], []
    for name, path in modules.items():
        if name.split(".")[0] == "stores":
            continue
        branches += _backend_branches(name, ast.parse(path.read_text()))
        reaching += [
            f"{name} -> {dep}"
            for dep in _imports(name, path, modules)
            if dep.split(".")[0] == "stores" and dep not in _STORES_SURFACE
        ]
    assert branches == [], (
        "only stores/ may ask which backend a path is on (add a Store method instead): "
        + ", ".join(branches)
    )
    assert reaching == [], (
        "outside stores/ only the registry and the Store interface are imported: "
        + ", ".join(reaching)
    )


def test_the_registry_is_the_one_place_a_filesystem_is_told_apart() -> None:
    # Naming an fsspec implementation (to tell which backend a filesystem is) happens in one table.
    offenders = [
        f"{name}:{node.lineno} {node.value!r}"
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if (
            isinstance(node, ast.Constant)
            and node.value in {"s3fs", "gcsfs", "adlfs", "AzureBlobFileSystem"}
            and name != "stores.registry"
        )
    ]
    assert offenders == []


def test_each_store_s_error_rules_live_beside_its_requests() -> None:
    # The retry policy judges a failure by the rules of the store that raised it (Store.errors):
    # no SDK's error codes or class names in the retry module or anywhere else.
    offenders = [
        f"{name}:{node.lineno} {node.value!r}"
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and node.value in _ERROR_SHAPES
        and name != _ERROR_SHAPES[node.value]
    ]
    assert offenders == []
    from hf_dcp_storage.stores.registry import _BACKENDS
    from hf_dcp_storage.stores.retry import FSSPEC_ERRORS, ErrorRules

    rules = {b.mode: b.store_class().errors for b in _BACKENDS}
    assert all(isinstance(r, ErrorRules) for r in rules.values())
    assert len({id(rules[m]) for m in ("s3", "gcs", "azure")} | {id(FSSPEC_ERRORS)}) == 4


def test_the_backend_checks_see_a_branch() -> None:
    tree = ast.parse(
        'if mode == "s3":\n    pass\nif fsio.is_azure(fs):\n    pass\nif "gcs" in kinds:\n    '
        'pass\nif x == "other":\n    pass\n'
    )
    assert len(_backend_branches("fake", tree)) == 3


def test_every_module_declares_its_surface_and_every_package_says_what_lives_there() -> None:
    modules = _modules()
    no_all = [
        n
        for n, p in modules.items()
        if p.name != "__init__.py" and n != "__main__" and "__all__" not in p.read_text()
    ]
    assert no_all == []
    for name, path in modules.items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc, f"{name}/__init__.py says nothing of what lives there"


def test_the_checks_above_see_a_climbing_import(tmp_path) -> None:
    # A plan module that imports the writer in a function, and a format module the plan.
    modules = _modules()
    fake = tmp_path / "fake.py"
    fake.write_text(
        "def f():\n    from ..writer import HFStorageWriter\n    from . import layout\n    from "
        "..format.header import dtype_name\n"
    )
    deps = _imports("plan.fake", fake, modules)
    assert deps == {"writer", "plan.layout", "format.header"}
    assert [d for d in deps if _layer(d) > _layer("plan.fake")] == ["writer"]


def test_every_module_imports_with_deprecation_warnings_as_errors() -> None:
    # As an application that treats warnings as errors imports us (under every supported torch:
    # scripts/experiments/compat.sh runs this suite under 2.14 and 2.15 too).
    import importlib.util
    import subprocess
    import sys

    # An integration imports only where its trainer is installed (the test above checks the
    # message otherwise; tests/integrations/ imports it where it is).
    absent = {m for m, trainer in _TRAINERS.items() if importlib.util.find_spec(trainer) is None}
    names = sorted(
        f"hf_dcp_storage.{m}" if m != "__init__" else "hf_dcp_storage"
        for m in _modules()
        if m != "__main__" and m not in absent
    )
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code, *names],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
