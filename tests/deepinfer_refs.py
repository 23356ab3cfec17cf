"""Call DeepInfer's and tile-kernels' pure-PyTorch ``*_ref`` functions on CPU without importing their packages.

Both packages import TileLang / CUDA at module level, so instead of importing them this harness reads a module's
source with :mod:`ast`, takes the requested top-level names plus the module-level functions, classes, constants and
imports they reference (recursively, following imports into the other modules of the two source trees), and
executes just those statements, one namespace per source module. Function annotations are dropped (they name
TileLang types); names imported from modules that cannot be imported here (``tilelang``, a package used as a value
such as ``tile_kernels.quant``) become placeholders that raise when touched, so a ref that only uses them on a
branch the caller does not take still works.

Sources: ``$DINFER_DEEPINFER_SRC`` (a directory made by ``scripts/fetch_deepinfer_source.py DIR``), else the cache
directory ``${XDG_CACHE_HOME:-~/.cache}/dinfer_jax/deepinfer-src`` that the same script fills (``pip download``) on
first use. The script unpacks into a private temporary directory which is renamed into place once complete, so a
directory that exists is complete and concurrent test workers need no lock. Without sources (no network)
:func:`load_ref` raises :class:`RefSourceUnavailable`; :func:`require_refs` reports that through
:func:`provision.missing` (a skip locally, a failure under ``CI``).

Limits: only top-level ``def`` / ``class`` / import / plain assignment bindings are seen (the last one wins);
module-level code that mutates a name later (loops, ``if`` blocks) is not replayed. Use ``overrides`` to supply a
module-level value that cannot be evaluated on CPU.

Usage::

    ref = load_ref("deepinfer/model_executor/layers/tilelang_ops/candidate_blocks.py", "candidate_block_max_ref")
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]
FETCH_SCRIPT = REPO_ROOT / "scripts" / "fetch_deepinfer_source.py"
HOW_TO_PROVIDE = (f"run `python {FETCH_SCRIPT.relative_to(REPO_ROOT)}` with network access (pip download of "
                  "deepinfer==0.1.0 and tile-kernels==2.1.0 into the cache), or set DINFER_DEEPINFER_SRC to a "
                  "directory that script made")


class RefSourceUnavailable(RuntimeError):
    """The DeepInfer / tile-kernels sources are not available (unset and could not be fetched)."""


@cache
def _fetcher() -> ModuleType:
    """``scripts/fetch_deepinfer_source.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("_dinfer_fetch_deepinfer_source", FETCH_SCRIPT)
    if spec is None or spec.loader is None:
        raise RefSourceUnavailable(f"cannot load {FETCH_SCRIPT}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def source_root() -> Path:
    """Directory holding ``deepinfer-0.1.0/`` and ``tile_kernels/``; fetched once into the cache if needed."""
    fetcher = _fetcher()
    env = os.environ.get("DINFER_DEEPINFER_SRC")
    if env:
        root = Path(env)
        if not fetcher.is_complete(root):
            raise RefSourceUnavailable(f"DINFER_DEEPINFER_SRC={env} is not a directory made by {FETCH_SCRIPT.name}")
        return root
    try:
        return fetcher.fetch()
    except fetcher.FetchError as e:
        raise RefSourceUnavailable(str(e)) from e


def require_refs() -> Path:
    """:func:`source_root`, or report the sources missing (skip locally, fail under ``CI``) with how to get them."""
    from provision import missing

    try:
        return source_root()
    except (RefSourceUnavailable, OSError) as e:
        missing(f"DeepInfer's reference sources ({e})", HOW_TO_PROVIDE)


# --- module resolution ---------------------------------------------------------------------------------------


def _package_roots() -> dict[str, Path]:
    root = source_root()
    return {"deepinfer": root / _fetcher().DEEPINFER_DIR, "tile_kernels": root}


def _module_file(module: str) -> Path | None:
    """Source file of an in-tree dotted module (``pkg/mod.py`` or ``pkg/mod/__init__.py``), else None."""
    base = _package_roots().get(module.split(".")[0])
    if base is None:
        return None
    path = base.joinpath(*module.split("."))
    for cand in (path.with_suffix(".py"), path / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _module_name(relpath: str) -> str:
    """``deepinfer/a/b.py`` or ``tile_kernels/torch/cast.py`` → dotted module name."""
    parts = Path(relpath).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """Absolute module name of a (possibly relative) ``from … import`` inside ``module``."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


# --- free-name analysis ----------------------------------------------------------------------------------------

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _outer_exprs(node: ast.AST) -> list[ast.AST]:
    """Parts of a def / class / lambda evaluated in the enclosing scope: decorators, defaults, bases."""
    if isinstance(node, _FUNCS):
        a = node.args
        return [*getattr(node, "decorator_list", []), *a.defaults, *[d for d in a.kw_defaults if d is not None]]
    return [*node.decorator_list, *node.bases, *node.keywords]


def _params(node: ast.AST) -> set[str]:
    a = node.args
    return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}


def _free_names(node: ast.AST) -> set[str]:
    """Names that ``node`` reads from the module scope.

    For a def / lambda: loads not bound inside it (comprehension variables count as bound; over-approximating
    local-ness only hides a global that shares its name with such a variable). For a class: the body's unbound
    loads plus its methods' free names (methods do not see class-level names). For any other statement or
    expression: every name it loads. Decorators, defaults and bases of ``node`` itself are not included.
    """
    scoped = isinstance(node, _SCOPES)
    todo: list[ast.AST] = ([node.body] if isinstance(node, ast.Lambda) else list(node.body)) if scoped else [node]
    bound = _params(node) if isinstance(node, _FUNCS) else set()
    loads: set[str] = set()
    inner: set[str] = set()
    while todo:
        n = todo.pop()
        if isinstance(n, _SCOPES):
            if not isinstance(n, ast.Lambda):
                bound.add(n.name)
            inner |= _free_names(n)
            todo.extend(_outer_exprs(n))
            continue
        if isinstance(n, ast.Name):
            (loads if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            bound |= {(al.asname or al.name).split(".")[0] for al in n.names}
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
        if isinstance(n, ast.AnnAssign) and isinstance(node, _FUNCS):  # local annotations are never evaluated
            todo.extend(x for x in (n.target, n.value) if x is not None)
            continue
        todo.extend(ast.iter_child_nodes(n))
    if not scoped:
        return loads | inner
    if isinstance(node, ast.ClassDef):
        return (loads - bound) | inner
    return (loads | inner) - bound


def _strip_function_annotations(tree: ast.AST) -> None:
    """Drop parameter / return annotations of every function (they are evaluated at ``def`` time)."""
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n.returns = None
            for a in [*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs, n.args.vararg, n.args.kwarg]:
                if a is not None:
                    a.annotation = None


# --- loading ---------------------------------------------------------------------------------------------------


class _Unavailable:
    """Stands for something that cannot be imported on CPU; raises when used."""

    def __init__(self, what: str, why: str) -> None:
        self._what, self._why = what, why

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise RuntimeError(f"{self._what} is unavailable in the CPU reference harness ({self._why})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._what} is unavailable in the CPU reference harness ({self._why})")


class _Module:
    """Top-level bindings of one source module and the namespace its selected statements run in."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.is_package = name, path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        _strip_function_annotations(tree)
        self.bindings: dict[str, ast.stmt] = {}
        for stmt in tree.body:
            for target in self._bound_by(stmt):
                self.bindings[target] = stmt
        self.ns: dict[str, Any] = {"__name__": f"_dinfer_ref.{name}", "__builtins__": builtins}
        self.path = path

    @staticmethod
    def _bound_by(stmt: ast.stmt) -> list[str]:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [stmt.name]
        if isinstance(stmt, ast.Assign):
            return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            return [stmt.target.id]
        if isinstance(stmt, ast.Import):
            return [(a.asname or a.name).split(".")[0] for a in stmt.names]
        if isinstance(stmt, ast.ImportFrom) and stmt.module != "__future__":
            return [a.asname or a.name for a in stmt.names]
        return []


class _Loader:
    def __init__(self, overrides: Mapping[str, Any]) -> None:
        self.modules: dict[str, _Module] = {}
        self.overrides = overrides
        self.in_progress: set[tuple[str, str]] = set()

    def module(self, name: str) -> _Module:
        if name not in self.modules:
            path = _module_file(name)
            if path is None:
                raise KeyError(f"module {name} is not in the DeepInfer / tile-kernels sources")
            self.modules[name] = _Module(name, path)
        return self.modules[name]

    def resolve(self, mod: _Module, name: str) -> Any:
        """Bind ``name`` (and what it needs) in ``mod.ns`` and return its value."""
        if name in mod.ns or (mod.name, name) in self.in_progress:
            return mod.ns.get(name)
        qualified = f"{mod.name}.{name}"
        if qualified in self.overrides:
            mod.ns[name] = self.overrides[qualified]
            return mod.ns[name]
        stmt = mod.bindings.get(name)
        if stmt is None:
            if hasattr(builtins, name):
                return getattr(builtins, name)
            raise NameError(f"{name} is not bound at the top level of {mod.path}")
        self.in_progress.add((mod.name, name))
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            mod.ns[name] = self._import(mod, stmt, name)
        else:
            self._exec(mod, stmt)
        self.in_progress.discard((mod.name, name))
        return mod.ns[name]

    def _exec(self, mod: _Module, stmt: ast.stmt) -> None:
        needed = _free_names(stmt)
        if isinstance(stmt, _SCOPES):
            needed = needed.union(*[_free_names(e) for e in _outer_exprs(stmt)])
        for dep in sorted(needed):
            if dep in mod.bindings or f"{mod.name}.{dep}" in self.overrides:
                self.resolve(mod, dep)
        if isinstance(stmt, ast.AnnAssign):  # module-level annotations are evaluated: keep only the value
            stmt = ast.Assign(targets=[stmt.target], value=stmt.value, lineno=stmt.lineno)
        tree = ast.fix_missing_locations(ast.Module(body=[stmt], type_ignores=[]))
        # dont_inherit: this file's ``from __future__ import annotations`` must not turn their annotations into
        # strings (dataclasses would then look the module up in sys.modules).
        exec(compile(tree, str(mod.path), "exec", dont_inherit=True), mod.ns)

    def _import(self, mod: _Module, stmt: ast.Import | ast.ImportFrom, name: str) -> Any:
        if isinstance(stmt, ast.Import):
            alias = next(a for a in stmt.names if (a.asname or a.name).split(".")[0] == name)
            target = alias.name if alias.asname else alias.name.split(".")[0]
            return self._import_external(target, target if alias.asname else alias.name)
        alias = next(a for a in stmt.names if (a.asname or a.name) == name)
        source = _absolute(mod.name, mod.is_package, stmt)
        if _module_file(source) is not None:
            # Like Python: a name bound in the package's __init__ shadows a submodule of the same name.
            if alias.name in self.module(source).bindings:
                return self.resolve(self.module(source), alias.name)
            return _Unavailable(f"{source}.{alias.name}", "in-tree modules are not loaded as values")
        module = self._import_external(source, source)
        if isinstance(module, _Unavailable):
            return _Unavailable(f"{source}.{alias.name}", f"{source} cannot be imported")
        try:
            return getattr(module, alias.name)
        except AttributeError:  # a submodule that its package does not import itself
            return self._import_external(f"{source}.{alias.name}", f"{source}.{alias.name}")

    @staticmethod
    def _import_external(target: str, full: str) -> Any:
        """Import an installed module (torch, math, typing, …); a placeholder if it is missing (tilelang)."""
        if target.split(".")[0] in _package_roots():
            return _Unavailable(target, "in-tree packages are not imported")
        try:
            importlib.import_module(full)
            return importlib.import_module(target)
        except ImportError as e:
            return _Unavailable(target, str(e))


def load_refs(module_relpath: str, *names: str, overrides: Mapping[str, Any] | None = None) -> list[Any]:
    """Values of top-level ``names`` of the source module at ``module_relpath`` (relative to the package roots,
    e.g. ``deepinfer/model_executor/layers/tilelang_ops/compress.py`` or ``tile_kernels/torch/cast.py``).

    ``overrides`` maps qualified module-level names (``"tile_kernels.config._DEFAULT_CLAMP_MIN_VALUES"``) to values
    used instead of evaluating their source. All names share one load, hence one namespace per source module.
    """
    loader = _Loader(overrides or {})
    mod = loader.module(_module_name(module_relpath))
    return [loader.resolve(mod, n) for n in names]


def load_ref(module_relpath: str, name: str, *, overrides: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """One top-level function (or other value) of a DeepInfer / tile-kernels module; see :func:`load_refs`."""
    return load_refs(module_relpath, name, overrides=overrides)[0]


TILELANG_OPS = "deepinfer/model_executor/layers/tilelang_ops/"   # DeepInfer's sampling / attention ops package


class LogitsTransformInputs(NamedTuple):
    """Stands in for DeepInfer's C++ ``LogitsTransformInputs`` (the ``_ref`` samplers read these three fields)."""
    temperatures: object
    top_ps: object
    top_ks: object


class SamplingKernelInputs(NamedTuple):
    """Stands in for DeepInfer's C++ ``SamplingKernelInputs``."""
    logits: object
    seq_seeds: object
    sample_positions: object


def sampling_input_overrides(module: str) -> dict[str, Any]:
    """``load_refs`` overrides putting the two stand-ins above into DeepInfer's ops module ``module`` (its last
    name, e.g. ``"fused_sample"``)."""
    prefix = TILELANG_OPS.rstrip("/").replace("/", ".") + f".{module}."
    return {prefix + "SamplingKernelInputs": SamplingKernelInputs,
            prefix + "LogitsTransformInputs": LogitsTransformInputs}


def tile_kernels_clamp_overrides(ops: str) -> dict[str, Any]:
    """``load_refs`` overrides giving tile-kernels' amax clamp table the values DeepInfer's kernels use.

    tile-kernels builds that table from TileLang dtype limits; here it comes from DeepInfer's own constants in
    ``{ops}common.py`` (``ops`` = DeepInfer's ops package path with a trailing slash), so no test restates the spec.
    """
    f8_min, f4_min, e4m3_min_pos, e2m1_max, e4m3_max = load_refs(
        ops + "common.py", "FP8_AMAX_MARGIN", "FP4_AMAX_MARGIN", "FLOAT8E4M3_MIN_POSITIVE", "FLOAT4_E2M1_MAX",
        "FLOAT8E4M3_MAX")
    clamps = {("e4m3", False): f8_min, ("e4m3", True): e4m3_max * e4m3_min_pos,
              ("e2m1", False): f4_min, ("e2m1", True): e2m1_max * e4m3_min_pos}
    return {"tile_kernels.config._DEFAULT_CLAMP_MIN_VALUES": clamps}
