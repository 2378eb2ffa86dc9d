"""Write megatron_lm_flags.txt: every flag name of Megatron-LM's command line.

    python3 tests/megatron_flags/extract.py MEGATRON_LM_GIT_DIR [COMMIT]

Megatron-LM's megatron/training/arguments.py makes its flags two ways, and both are read here with
`ast` (megatron is not imported), names only, not the help texts:

- `add_argument` calls: their option strings, and the `--no-X` that argparse's
  `BooleanOptionalAction` adds beside each `--X`;
- `ArgumentGroupFactory(ConfigClass, exclude=[...])`: a flag for each field of the dataclass
  (its base dataclasses' fields included) that is not excluded and not `init=False`, named as
  megatron/training/argument_utils.py names it: `--field-name`; a `bool` field whose default is
  not False is a store_false switch named `--no-field-name` and `--disable-field-name`; and
  `metadata={"argparse_meta": {"arg_names": [...]}}` replaces the names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPOSITORY = "https://github.com/NVIDIA/Megatron-LM"
ARGUMENTS_PATH = "megatron/training/arguments.py"
CONFIG_PATHS = ("megatron/core/model_parallel_config.py",
                "megatron/core/transformer/transformer_config.py",
                "megatron/training/config/common_config.py",
                "megatron/training/config/training_config.py",
                "megatron/training/config/resilience_config.py",
                "megatron/core/fault_injector.py")
"""The files defining the dataclasses that arguments.py hands to ArgumentGroupFactory."""
OUTPUT = Path(__file__).with_name("megatron_lm_flags.txt")
MISSING = object()
"""A field without a plain default (none, or a default_factory): dataclasses.MISSING."""


class TypeInferenceError(Exception):
    """Where ArgumentGroupFactory._extract_type raises its TypeInferenceError."""


def flag_names(source: str) -> list[str]:
    """The sorted, distinct option strings (`--x`) of every `*.add_argument(...)` in `source`,
    with the `--no-x` of those whose action is argparse.BooleanOptionalAction."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            options = [arg.value for arg in node.args if isinstance(arg, ast.Constant)
                       and isinstance(arg.value, str) and arg.value.startswith("--")]
            names.update(options)
            action = next((k.value for k in node.keywords if k.arg == "action"), None)
            if _name(action) == "BooleanOptionalAction":
                names.update("--no-" + option[2:] for option in options)
    return sorted(names)


def factory_calls(source: str) -> list[tuple[str, frozenset[str]]]:
    """(dataclass name, excluded field names) of every `ArgumentGroupFactory(...)` in `source`;
    an `exclude` given as a variable is read from its assignment in the innermost enclosing
    function (or the module)."""
    tree = ast.parse(source)
    scopes = [tree, *(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef))]
    calls = {}
    for scope in scopes:  # outer scopes first: an inner function's reading wins
        assigned = {target.id: node.value for node in ast.walk(scope)
                    if isinstance(node, ast.Assign) for target in node.targets
                    if isinstance(target, ast.Name)}
        for node in ast.walk(scope):
            if isinstance(node, ast.Call) and _name(node.func) == "ArgumentGroupFactory":
                exclude = ([k.value for k in node.keywords if k.arg == "exclude"]
                           + node.args[1:2])
                if exclude and isinstance(exclude[0], ast.Name):
                    exclude = [assigned[exclude[0].id]]
                names = ast.literal_eval(exclude[0]) if exclude else ()
                calls[node] = (_name(node.args[0]), frozenset(names or ()))
    return list(calls.values())


def dataclass_fields(sources: list[str], class_name: str) -> list[ast.AnnAssign]:
    """The fields of the @dataclass `class_name` defined in `sources`, its bases' first and a
    field a subclass redefines in its base's place, as dataclasses.fields lists them."""
    classes = {}
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                if node.name in classes:
                    raise ValueError(f"two classes named {node.name}")
                classes[node.name] = node

    def fields(name: str) -> dict[str, ast.AnnAssign]:
        node = classes[name]
        if not any(_name(d.func if isinstance(d, ast.Call) else d) == "dataclass"
                   for d in node.decorator_list):
            raise ValueError(f"{name} is not a dataclass")
        found = {}
        for base in node.bases:
            found.update(fields(_name(base)))
        for statement in node.body:
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and _name(_generic(statement.annotation)) not in ("ClassVar", "InitVar")):
                found[statement.target.id] = statement
        return found

    return list(fields(class_name).values())


def field_flag_names(field: ast.AnnAssign) -> list[str] | None:
    """The option strings ArgumentGroupFactory gives one dataclass field; None when it makes
    none (`init=False`)."""
    name = field.target.id
    keywords = {}
    if isinstance(field.value, ast.Call) and _name(field.value.func) == "field":
        keywords = {k.arg: k.value for k in field.value.keywords}
        default = _literal(keywords["default"]) if "default" in keywords else MISSING
    else:
        default = MISSING if field.value is None else _literal(field.value)
    if "init" in keywords and ast.literal_eval(keywords["init"]) is False:
        return None
    meta = _argparse_meta(keywords.get("metadata"))
    if "arg_names" in meta:
        return list(ast.literal_eval(meta["arg_names"]))
    try:
        is_bool = _inferred_type(field.annotation) == "bool"
    except TypeInferenceError:
        if meta:  # Megatron-LM defers to the metadata, which keeps the plain name
            return [_flag(name)]
        raise
    if not is_bool or default == False:  # noqa: E712  (Megatron-LM's test: 0 counts as False)
        return [_flag(name)]
    if default is not MISSING and not isinstance(default, (bool, int, float, type(None))):
        raise ValueError(f"{name}: a bool field whose default is not a literal")
    return [_flag("no_" + name), _flag("disable_" + name)]  # store_false


def factory_flag_names(arguments: str, configs: list[str]) -> list[str]:
    """The sorted, distinct names every ArgumentGroupFactory call in `arguments` makes from the
    dataclasses defined in `configs`."""
    names = set()
    for class_name, exclude in factory_calls(arguments):
        for field in dataclass_fields(configs, class_name):
            if field.target.id not in exclude:
                names.update(field_flag_names(field) or ())
    return sorted(names)


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _name(node: ast.expr | None) -> str | None:
    """`x` of a Name `x` or an Attribute `a.b.x`."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _generic(annotation: ast.expr) -> ast.expr:
    """`X` of `X[...]`, else the annotation."""
    return annotation.value if isinstance(annotation, ast.Subscript) else annotation


def _literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return node  # an expression (an enum member, a function): not a literal default


def _argparse_meta(metadata: ast.expr | None) -> dict[str, ast.expr]:
    """The keys of `metadata={"argparse_meta": {...}}`, with their value expressions."""
    if not isinstance(metadata, ast.Dict):
        return {}
    for key, value in zip(metadata.keys, metadata.values):
        if isinstance(key, ast.Constant) and key.value == "argparse_meta":
            return {k.value: v for k, v in zip(value.keys, value.values)}
    return {}


def _union_members(annotation: ast.expr) -> list[ast.expr]:
    """The flattened members of `A | B` or `Union[A, B]` or `Optional[A]`, as typing flattens
    them; a single member for any other annotation."""
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _union_members(annotation.left) + _union_members(annotation.right)
    generic = _name(_generic(annotation)) if isinstance(annotation, ast.Subscript) else None
    if generic in ("Union", "Optional"):
        inner = annotation.slice
        members = inner.elts if isinstance(inner, ast.Tuple) else [inner]
        if generic == "Optional":
            members = [*members, ast.Constant(None)]
        return [m for member in members for m in _union_members(member)]
    return [annotation]


def _inferred_type(annotation: ast.expr) -> str:
    """The type name ArgumentGroupFactory._extract_type infers (it matters only whether it is
    'bool'); TypeInferenceError where that raises."""
    members = _union_members(annotation)
    if len(members) > 1:
        if isinstance(members[1], ast.Constant) and members[1].value is None:
            return _inferred_type(members[0])  # Optional: the type inside
        raise TypeInferenceError(ast.unparse(annotation))
    if isinstance(annotation, ast.Constant):
        return type(annotation.value).__name__ if annotation.value is not None else "NoneType"
    if not isinstance(annotation, ast.Subscript):
        if _name(annotation) in ("Callable", "Dict", "Tuple", "Sequence"):
            raise TypeInferenceError(ast.unparse(annotation))
        return _name(annotation) or ast.unparse(annotation)
    generic, inner = _name(annotation.value), annotation.slice
    if generic in ("list", "List") and not isinstance(inner, ast.Tuple):
        return _inferred_type(inner)
    if generic == "Literal":
        first = inner.elts[0] if isinstance(inner, ast.Tuple) else inner
        return type(ast.literal_eval(first)).__name__
    raise TypeInferenceError(ast.unparse(annotation))


def _git_show(git_dir: str, commit: str, path: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"],
                          check=True, capture_output=True, text=True, timeout=60).stdout


def main(git_dir: str, commit: str = "HEAD") -> None:
    commit = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", commit], check=True,
                            capture_output=True, text=True, timeout=60).stdout.strip()
    arguments = _git_show(git_dir, commit, ARGUMENTS_PATH)
    configs = [_git_show(git_dir, commit, path) for path in CONFIG_PATHS]
    names = sorted(set(flag_names(arguments)) | set(factory_flag_names(arguments, configs)))
    header = [f"# Flag names of {REPOSITORY} at commit {commit}, {ARGUMENTS_PATH}:",
              "# its add_argument calls, and the fields its ArgumentGroupFactory makes flags of,",
              "# of the dataclasses in",
              *(f"#   {path}" for path in CONFIG_PATHS),
              "# Names only, written by tests/megatron_flags/extract.py."]
    OUTPUT.write_text("\n".join(header + names) + "\n")
    print(f"{len(names)} names -> {OUTPUT}")


if __name__ == "__main__":
    main(*sys.argv[1:])
