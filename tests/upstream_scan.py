"""An AST scan of lmforge's source for every place it touches upstream internals or patches an
upstream object: what tests/test_upstream_registry.py holds against lmforge/upstream.py's REGISTRY.

Upstream packages are torch, transformers, accelerate, peft, trl, deepspeed, optuna and mlflow.
The scan does not know the type of a local variable, so it is conservative where it cannot tell:

- private (an underscore name, not a dunder):
  * `from pkg.mod import _name` and any import through a private module (`pkg._mod`);
  * `x._name`, `getattr/hasattr/setattr/delattr(x, "_name")` (constant name expressions are folded)
    where `x` is rooted at an upstream import (or a local bound to one);
  * the same on any other receiver when lmforge itself declares no attribute, function or class of
    that name (then the receiver is presumed to be an upstream object: `trainer._logs`);
  * `self._name` in a class on the upstream side (it subclasses an upstream class, or is mixed into
    one) when lmforge does not declare `_name` there, or the upstream bases define or set it too;
  * a private method defined in an upstream-side class that overrides one of its upstream bases.
- patch (an assignment, augmented assignment, `del` or `setattr`/`delattr` onto an upstream object):
  * onto anything rooted at an upstream import (`torch.load = ...`, `ring.custom_ops[op] = ...`);
  * onto any other receiver when the attribute is no data attribute of a plain lmforge class
    (`head.forward = ...`, `model.config.x = ...`, `trainer.x = ...`);
  * `self.x = ...` in an upstream-side class when its upstream bases define or set `x`.

A false positive is resolved by registering the coupling in upstream.py, never by an allow-list.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal

UPSTREAM = ("torch", "transformers", "accelerate", "peft", "trl", "deepspeed", "optuna", "mlflow")
BUILTIN_TYPES = {"str", "int", "float", "bool", "bytes", "dict", "list", "tuple", "set", "type", "Path"}
# namedtuple's public methods carry an underscore so as not to clash with field names.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
ATTRIBUTE_BUILTINS = {"getattr": "read", "hasattr": "read", "setattr": "write", "delattr": "write"}
Kind = Literal["private", "patch"]


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    kind: Kind
    name: str  # the private name, or the patched attribute
    package: str | None  # the upstream package, when the receiver is known to be one
    code: str
    imported: bool = True  # the receiver is an upstream import; else its package is from an annotation

    def __str__(self) -> str:
        where = self.package or "an upstream object (receiver type unknown)"
        return f"{self.path}:{self.line}: {self.kind} `{self.name}` of {where}: {self.code}"


def is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def is_private(name: str) -> bool:
    return name.startswith("_") and not is_dunder(name) and name not in NAMEDTUPLE_API


def upstream_package(dotted: str) -> str | None:
    top = dotted.split(".", 1)[0]
    return top if top in UPSTREAM else None


@dataclass
class ClassInfo:
    name: str
    base_exprs: list[str]  # dotted, as resolved in its file (upstream paths, or lmforge class names)
    declared: set[str] = field(default_factory=set)  # class-body names and self.<name> assignments
    data_attributes: set[str] = field(default_factory=set)  # the same, methods excluded
    upstream_bases: set[str] = field(default_factory=set)  # dotted upstream classes, own or inherited
    upstream_side: bool = False


@dataclass
class Declarations:
    """What lmforge declares itself, across every scanned file."""

    classes: dict[str, ClassInfo] = field(default_factory=dict)
    module_names: set[str] = field(default_factory=set)
    imported_upstream: set[str] = field(default_factory=set)  # dotted upstream names lmforge imports

    @property
    def upstream_private_names(self) -> frozenset[str]:
        """The private names of every upstream class lmforge imports (theirs even where lmforge
        declares one of the same name: a decoy declaration does not hide `trainer._logs`)."""
        return frozenset(n for n in upstream_names(frozenset(self.imported_upstream)) if is_private(n))

    def own(self, info: ClassInfo, names: set[str]) -> set[str]:
        """`names` declared in `info`, less those its upstream bases define or set (not lmforge's)."""
        return names - upstream_names(frozenset(info.upstream_bases)) if info.upstream_side else names

    @property
    def own_data_attributes(self) -> set[str]:
        """Data attributes lmforge's classes declare for themselves (methods excluded)."""
        return {n for c in self.classes.values() for n in self.own(c, c.data_attributes)}

    @property
    def any_name(self) -> set[str]:
        names = set(self.module_names)
        for info in self.classes.values():
            names |= self.own(info, info.declared)
        return names

    def family(self, name: str) -> set[str]:
        """`name` and its lmforge bases, transitively."""
        seen: set[str] = set()
        todo = [name]
        while todo:
            current = todo.pop()
            if current in seen or current not in self.classes:
                continue
            seen.add(current)
            todo += [
                b.rsplit(".", 1)[-1] for b in self.classes[current].base_exprs if not upstream_package(b)
            ]
        return seen


def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted upstream path, for every upstream import anywhere in the file."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if upstream_package(alias.name):
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".", 1)[0]
                        aliases[top] = top
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and not node.level
            and upstream_package(node.module)
        ):
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _other_imports(tree: ast.AST) -> set[str]:
    """Local names bound by imports of anything but an upstream package (os, logging, lmforge)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".", 1)[0] for a in node.names if not upstream_package(a.name)}
        elif isinstance(node, ast.ImportFrom) and (node.level or not upstream_package(node.module or "")):
            names |= {a.asname or a.name for a in node.names}
    return names


def _roots(annotation: ast.expr) -> list[str]:
    """The dotted type names an annotation mentions (`X | None`, `Optional[X]`, `list[X]` give X)."""
    if isinstance(annotation, ast.BinOp):
        return _roots(annotation.left) + _roots(annotation.right)
    if isinstance(annotation, ast.Subscript):
        outer = ast.unparse(annotation.value)
        if outer in ("Optional", "typing.Optional", "Union", "typing.Union"):
            inner = annotation.slice
            return [r for e in (inner.elts if isinstance(inner, ast.Tuple) else [inner]) for r in _roots(e)]
        return [outer]
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return []
    return [ast.unparse(annotation)]


class _Resolver:
    """Dotted upstream path of an expression rooted at an upstream import, or None; and whether a
    receiver is known to be no upstream object (a stdlib module, an annotated lmforge type)."""

    def __init__(self, tree: ast.AST, lmforge_classes: Iterable[str] = ()) -> None:
        self.aliases = _imports(tree)
        self.others = _other_imports(tree) | set(lmforge_classes)
        self.annotated: dict[str, str] = {}  # local -> upstream path of its annotated type
        self.not_upstream: set[str] = set()  # locals annotated with types that are no upstream objects
        annotations: list[tuple[str, ast.expr]] = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                every = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                annotations += [(a.arg, a.annotation) for a in every if a.annotation is not None]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                annotations.append((node.target.id, node.annotation))
        unsure: set[str] = set()
        for name, annotation in annotations:
            roots = _roots(annotation)
            upstream = [p for r in roots if (p := self._type_path(r))]
            if upstream:
                self.annotated.setdefault(name, upstream[0])
            elif roots and all(self._plain_type(r) for r in roots):
                self.not_upstream.add(name)
            else:
                unsure.add(name)
        # One name annotated differently in two functions: only what every annotation agrees on.
        self.not_upstream -= unsure | set(self.annotated)
        # Locals bound to an upstream expression (`aten = torch.ops.aten`), to a fixpoint.
        changed = True
        while changed:
            changed = False
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                ):
                    name = node.targets[0].id
                    path = self.path(node.value)
                    # An attribute chain (`aten = torch.ops.aten`); what a call returns is a value of
                    # lmforge's own (a tensor, a model), judged by the rules for unknown receivers.
                    if path is not None and "(" not in path and "[" not in path and name not in self.aliases:
                        self.aliases[name] = path
                        changed = True

    def _type_path(self, dotted: str) -> str | None:
        root, _, rest = dotted.partition(".")
        base = self.aliases.get(root)
        return (f"{base}.{rest}" if rest else base) if base else None

    def _plain_type(self, dotted: str) -> bool:
        root = dotted.split(".", 1)[0]
        return root in self.others or (root in BUILTIN_TYPES and root not in ("Any", "object"))

    def imported(self, node: ast.expr) -> bool:
        """Rooted at an upstream import (not at a local whose annotation names an upstream type)."""
        while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return isinstance(node, ast.Name) and node.id in self.aliases

    def is_other(self, node: ast.expr) -> bool:
        """A receiver known not to be an upstream object: a module or type imported from elsewhere,
        or a local annotated with such a type."""
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and (node.id in self.others or node.id in self.not_upstream)

    def path(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id) or self.annotated.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.path(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            base = self.path(node.func)
            return f"{base}()" if base else None
        if isinstance(node, ast.Subscript):
            base = self.path(node.value)
            return f"{base}[]" if base else None
        return None


def constant_string(node: ast.expr) -> str | None:
    """The value of a string expression built from constants ("_" + "logs", f"_{'logs'}"), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = constant_string(node.left), constant_string(node.right)
        return left + right if left is not None and right is not None else None
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            part = constant_string(value.value if isinstance(value, ast.FormattedValue) else value)
            if part is None:
                return None
            parts.append(part)
        return "".join(parts)
    return None


def _class_infos(tree: ast.AST, resolver: _Resolver) -> Iterator[ClassInfo]:
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [resolver.path(b) or ast.unparse(b) for b in node.bases]
        info = ClassInfo(node.name, bases)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                info.declared.add(item.name)
                if any(ast.unparse(d).endswith(("property", "cached_property")) for d in item.decorator_list):
                    info.data_attributes.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                info.declared.add(item.target.id)
                info.data_attributes.add(item.target.id)
            elif isinstance(item, ast.Assign):
                for target in item.targets:
                    if isinstance(target, ast.Name):
                        info.declared.add(target.id)
                        info.data_attributes.add(target.id)
        for inner in ast.walk(node):
            for target in _assigned(inner):
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in ("self", "cls")
                ):
                    info.declared.add(target.attr)
                    info.data_attributes.add(target.attr)
        yield info


def _assigned(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [t for target in node.targets for t in _unpack(target)]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)) and (
        not isinstance(node, ast.AnnAssign) or node.value
    ):
        return _unpack(node.target)
    if isinstance(node, ast.Delete):
        return [t for target in node.targets for t in _unpack(target)]
    if isinstance(node, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)):
        targets = (
            [node.target]
            if isinstance(node, (ast.For, ast.AsyncFor))
            else [i.optional_vars for i in node.items if i.optional_vars is not None]
        )
        return [t for target in targets for t in _unpack(target)]
    return []


def _unpack(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for element in target.elts for t in _unpack(element)]
    if isinstance(target, ast.Starred):
        return _unpack(target.value)
    return [target]


def collect_declarations(sources: dict[str, str]) -> Declarations:
    """Every class lmforge defines (by name) and which of them sit on the upstream side."""
    declarations = Declarations()
    for source in sources.values():
        tree = ast.parse(source)
        resolver = _Resolver(tree)
        declarations.imported_upstream |= set(resolver.aliases.values())
        for info in _class_infos(tree, resolver):
            known = declarations.classes.get(info.name)
            if known is not None:  # two lmforge classes of one name: merged, as conservative for both
                known.base_exprs += info.base_exprs
                known.declared |= info.declared
                known.data_attributes |= info.data_attributes
            else:
                declarations.classes[info.name] = info
        for node in tree.body:  # type: ignore[attr-defined]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                declarations.module_names.add(node.name)
            for target in _assigned(node):
                if isinstance(target, ast.Name):
                    declarations.module_names.add(target.id)
    classes = declarations.classes
    for info in classes.values():
        info.upstream_bases = {b for b in info.base_exprs if upstream_package(b)}
    changed = True
    while changed:  # upstream bases through lmforge bases, and mixins of upstream-side classes
        changed = False
        for info in classes.values():
            for base in info.base_exprs:
                other = classes.get(base.rsplit(".", 1)[-1])
                if other is None or upstream_package(base):
                    continue
                if not other.upstream_bases >= info.upstream_bases:  # a mixin takes its host's bases
                    other.upstream_bases |= info.upstream_bases
                    changed = True
                if not info.upstream_bases >= other.upstream_bases:
                    info.upstream_bases |= other.upstream_bases
                    changed = True
    for info in classes.values():
        info.upstream_side = bool(info.upstream_bases)
    return declarations


@cache
def _resolve_class(dotted: str) -> type | None:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj if isinstance(obj, type) else None
    return None


@cache
def upstream_names(dotted_bases: frozenset[str]) -> frozenset[str]:
    """Every name the upstream classes (and their upstream ancestors) define, or set on self."""
    names: set[str] = set()
    for dotted in dotted_bases:
        cls = _resolve_class(dotted)
        if cls is None:
            continue
        for klass in cls.__mro__:
            if klass is object:
                continue
            names |= set(vars(klass))
            names |= _self_assignments(klass)
    return frozenset(names)


@cache
def _self_assignments(klass: type) -> frozenset[str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(
        target.attr
        for node in ast.walk(tree)
        for target in _assigned(node)
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    )


class _FileScan(ast.NodeVisitor):
    def __init__(self, path: str, tree: ast.AST, declarations: Declarations, lines: list[str]) -> None:
        self.path = path
        self.resolver = _Resolver(tree, declarations.classes)
        self.own_data_attributes = declarations.own_data_attributes
        self.upstream_private = declarations.upstream_private_names
        self.any_name = declarations.any_name - self.upstream_private
        self.declarations = declarations
        self.lines = lines
        self.classes: list[str] = []
        self.findings: list[Finding] = []
        self.write_targets: set[int] = set()
        for node in ast.walk(tree):
            for target in _assigned(node):
                self.write_targets.add(id(target))

    # -- helpers -------------------------------------------------------------------------
    def _add(self, node: ast.AST, kind: Kind, name: str, package: str | None, imported: bool = True) -> None:
        line = getattr(node, "lineno", 0)
        code = self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""
        self.findings.append(Finding(self.path, line, kind, name, package, code, imported))

    def _upstream_class(self) -> ClassInfo | None:
        if not self.classes:
            return None
        info = self.declarations.classes.get(self.classes[-1])
        return info if info is not None and info.upstream_side else None

    def _lmforge_declares_in_family(self, info: ClassInfo, name: str) -> bool:
        return any(name in self.declarations.classes[c].declared for c in self.declarations.family(info.name))

    def _judge(self, node: ast.AST, receiver: ast.expr, name: str, *, write: bool) -> None:
        """A read (`write=False`) or a write of attribute `name` on `receiver`."""
        path = self.resolver.path(receiver)
        if path is not None:
            imported = self.resolver.imported(receiver)
            if write:
                self._add(node, "patch", name, upstream_package(path), imported)
            elif is_private(name):
                self._add(node, "private", name, upstream_package(path), imported)
            return
        if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls") and self.classes:
            info = self._upstream_class()
            if info is None:
                return  # a plain lmforge class's own attribute
            theirs = name in upstream_names(frozenset(info.upstream_bases))
            package = upstream_package(next(iter(sorted(info.upstream_bases))))
            if theirs and (write or is_private(name)):
                self._add(node, "private" if is_private(name) else "patch", name, package)
            elif is_private(name) and not self._lmforge_declares_in_family(info, name):
                self._add(node, "private", name, package)
            return
        if self.resolver.is_other(receiver) or is_dunder(name):
            return  # os._exit, a LogRecord, a function's __name__: no upstream object
        if write:
            if name not in self.own_data_attributes or name in self.upstream_private:
                self._add(node, "patch", name, None)
        elif is_private(name) and name not in self.any_name:
            self._add(node, "private", name, None)

    # -- visitors ------------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        info = self._upstream_class()
        if info is not None:
            theirs = upstream_names(frozenset(info.upstream_bases))
            package = upstream_package(next(iter(sorted(info.upstream_bases))))
            for item in node.body:
                overrides = isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in theirs
                if overrides and is_private(item.name):
                    self._add(item, "private", item.name, package)
        self.generic_visit(node)
        self.classes.pop()

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._module_path(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level and upstream_package(node.module):
            self._module_path(node, node.module)
            for alias in node.names:
                if is_private(alias.name):
                    self._add(node, "private", alias.name, upstream_package(node.module))

    def _module_path(self, node: ast.AST, dotted: str) -> None:
        package = upstream_package(dotted)
        if package:
            for part in dotted.split("."):
                if is_private(part):
                    self._add(node, "private", part, package)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._judge(node, node.value, node.attr, write=id(node) in self.write_targets)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if id(node) in self.write_targets:
            path = self.resolver.path(node.value)
            if path is not None and "(" not in path:  # an item written into an upstream table
                self._add(node, "patch", path.rsplit(".", 1)[-1], upstream_package(path))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ATTRIBUTE_BUILTINS and len(node.args) >= 2:
            name = constant_string(node.args[1])
            if name is not None:
                self._judge(node, node.args[0], name, write=ATTRIBUTE_BUILTINS[func.id] == "write")
        is_import = (isinstance(func, ast.Name) and func.id == "__import__") or (
            isinstance(func, ast.Attribute) and func.attr == "import_module"
        )
        if is_import and node.args:
            module = constant_string(node.args[0])
            if module is not None:
                self._module_path(node, module)
        self.generic_visit(node)


def scan_sources(sources: dict[str, str], declarations: Declarations | None = None) -> list[Finding]:
    """Every finding in `sources` (path -> text); declarations from `sources` unless given."""
    declarations = declarations or collect_declarations(sources)
    findings: list[Finding] = []
    for path, source in sources.items():
        tree = ast.parse(source)
        scan = _FileScan(path, tree, declarations, source.splitlines())
        scan.visit(tree)
        findings += scan.findings
    return sorted(set(findings), key=lambda f: (f.path, f.line, f.name))


def read_package(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.py"))}


def registered_names(targets: Iterable[str]) -> dict[str, set[str]]:
    """Upstream package -> every name segment of the registered targets (module:qualname)."""
    names: dict[str, set[str]] = {}
    for target in targets:
        package = target.split(".", 1)[0].split(":", 1)[0]
        names.setdefault(package, set()).update(target.replace(":", ".").split("."))
    return names


def unregistered(findings: Iterable[Finding], targets: Iterable[str]) -> list[Finding]:
    """The findings no registry target covers: one that names the same upstream package (any, when
    the receiver's package is unknown or only annotated: `model: nn.Module` may be a transformers
    model) and has the finding's name among its segments."""
    names = registered_names(targets)
    everywhere = set().union(*names.values()) if names else set()
    return [
        f
        for f in findings
        if f.name not in (names.get(f.package, set()) if f.package and f.imported else everywhere)
    ]
