"""The house rules, checked on the source: data flows one way between the rooms, no room reads
another's private fields, torch's internals are touched in one module only, no module or class
grows past what one idea needs (``MAX_MODULE_LINES``, ``MAX_CLASS_LINES``), and no room holds more
modules than a reader takes in at once (``MAX_PACKAGE_MODULES``; past it, it splits into rooms).

The import rules are import-linter contracts (pyproject.toml, ``[tool.importlinter]``); the
private-field rule is read off the syntax tree: an attribute or name with one leading underscore
may be used on ``self``/``cls`` only (and imported from the room's own modules), anywhere but
``autopatch/torch_internals.py``.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from spawn import ROOT

PACKAGE = ROOT / "autopatch"
TORCH_INTERNALS = PACKAGE / "torch_internals.py"
# What the standard library or a library's documented convention names with an underscore.
ALLOWED = {"os._exit", "sys._getframe"}
ALLOWED_PREFIXES = ("_self_",)      # wrapt's ObjectProxy keeps its own attributes under this prefix
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 250               # from the ``class`` line to its last statement
MAX_PACKAGE_MODULES = 20            # modules on one level of a folder, ``__init__.py`` included
# Classes still past MAX_CLASS_LINES, by file and name; the test fails once one of them is back under,
# so the list only shrinks.
OVER_THE_LIMIT = {("autopatch/modes/chooser.py", "ModeChooser")}


def _private(name):
    return name.startswith("_") and not name.startswith("__") and not name.startswith(ALLOWED_PREFIXES)


def _owner_is_self(node):
    base = node.value
    if isinstance(base, ast.Name) and base.id in ("self", "cls"):
        return True
    # type(self)._x and super()._x are the object's own
    return isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id in ("type", "super")


def private_uses(path):
    """(line, text) of every use of another object's private name in the file at ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _owner_is_self(node):
            text = ast.unparse(node)
            if text not in ALLOWED:
                out.append((node.lineno, text))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and node.level != 1:     # a room's own modules may be private
            module = node.module or ""
            if any(_private(part) for part in module.split(".")):
                out.append((node.lineno, f"from {module} import ..."))
            out += [(node.lineno, f"from {module} import {a.name}") for a in node.names if _private(a.name)]
    return out


def test_no_room_reads_another_objects_private_fields():
    found = [f"{path.relative_to(ROOT)}:{line}: {text}" for path in sorted(PACKAGE.rglob("*.py"))
             if path != TORCH_INTERNALS for line, text in private_uses(path)]
    assert not found, "private names used outside their owner (add a seam, or a torch_internals entry):\n" + \
        "\n".join(found)


def test_the_rule_catches_what_it_is_about(tmp_path):
    """The checker itself finds each kind of reach-in (a rule that cannot fail checks nothing)."""
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nfrom torch.utils._foreach_utils import x\nfrom a import _b\n"
                      "def f(o):\n    o._field = 1\n    getattr(o, '_other')\n    return self._mine, o.__dict__\n")
    assert [text for _, text in private_uses(sample)] == [
        "from torch.utils._foreach_utils import ...", "from a import _b", "o._field", "getattr(o, '_other')"]


def test_imports_follow_the_flow_between_rooms():
    pytest.importorskip("importlinter")
    lint = Path(sys.executable).with_name("lint-imports")     # the console script of this environment
    res = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "BROKEN" not in res.stdout and "KEPT" in res.stdout


PATCHES = PACKAGE / "patches"
# Calls that change torch for every object (an attribute of a torch class or module, a global hook,
# a hook on an import): only the patch room makes them, each recorded in the one ledger.
PATCHING_CALLS = {"wrap_function_wrapper", "register_post_import_hook", "register_module_forward_pre_hook",
                  "register_module_forward_hook", "register_module_full_backward_hook",
                  "register_module_full_backward_pre_hook", "register_module_backward_hook",
                  "register_optimizer_step_pre_hook", "register_optimizer_step_post_hook"}
LEDGER_NAMES = {"Ledger", "Section", "LEDGER"}


def patching_outside_the_room(path):
    """(line, text) of every call in the file at ``path`` that patches torch, and of every use of
    the ledger itself: outside autopatch/patches/ both are defects (``disable()`` in
    autopatch/__init__.py empties the ledger, and may name it)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in PATCHING_CALLS:
                out.append((node.lineno, ast.unparse(node.func)))
        elif isinstance(node, ast.ImportFrom) and "patches.ledger" in (node.module or "") or \
                isinstance(node, ast.ImportFrom) and (node.module or "").endswith("patching"):
            out += [(node.lineno, f"import {a.name}") for a in node.names if a.name in LEDGER_NAMES]
    return out


def test_every_patch_lives_in_the_patch_room():
    found = [f"{path.relative_to(ROOT)}:{line}: {text}" for path in sorted(PACKAGE.rglob("*.py"))
             if PATCHES not in path.parents and path != PACKAGE / "__init__.py"
             for line, text in patching_outside_the_room(path)]
    assert not found, "torch patched outside autopatch/patches/ (add a patch module there):\n" + "\n".join(found)


def test_the_patch_rule_catches_what_it_is_about(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import wrapt, torch\nfrom ..patches.ledger import LEDGER, when_imported\n"
                      "wrapt.wrap_function_wrapper(torch.nn.Module, 'forward', f)\n"
                      "torch.nn.modules.module.register_module_forward_pre_hook(g)\n"
                      "register_optimizer_step_pre_hook(h)\nmodel.register_forward_pre_hook(k)\n")
    assert [text for _, text in patching_outside_the_room(sample)] == [
        "import LEDGER", "wrapt.wrap_function_wrapper", "torch.nn.modules.module.register_module_forward_pre_hook",
        "register_optimizer_step_pre_hook"]


def knob_outside_its_setting(knob):
    """The default bounds of autotune's ``knob`` that the policy setting it sets refuses, as
    readable lines: a knob is declared by its setting, never with limits of its own."""
    from autopatch.policy import KEYS
    if knob.setting not in KEYS:
        return [f"{knob.name}: sets {knob.setting}, which is no policy setting"]
    values = range(knob.bounds[0], knob.bounds[1] + 1) if knob.exponent else knob.bounds
    out = []
    for value in values:
        taken = knob.handle_value(value)
        try:
            ok = KEYS[knob.setting].check(taken) == taken
        except (TypeError, ValueError):
            ok = False
        if not ok:
            out.append(f"{knob.name}: {value!r} ({taken!r}) is refused by {knob.setting}")
    return out


def test_every_knob_bound_lies_inside_its_setting():
    from autopatch.tunables import KNOBS
    found = [line for knob in KNOBS.values() for line in knob_outside_its_setting(knob)]
    assert not found, "\n".join(found)


def test_the_knob_rule_catches_what_it_is_about():
    from autopatch.tunables import ALLREDUCE, OPTIMIZERS, Knob
    assert knob_outside_its_setting(Knob("small", OPTIMIZERS, "chunk_bytes", "fusion.chunk_bytes", (6, 10),
                                         exponent=True)) == [
        "small: 6 (64) is refused by fusion.chunk_bytes", "small: 7 (128) is refused by fusion.chunk_bytes",
        "small: 8 (256) is refused by fusion.chunk_bytes", "small: 9 (512) is refused by fusion.chunk_bytes"]
    assert knob_outside_its_setting(Knob("codec", ALLREDUCE, "compression", "allreduce.compression",
                                         ("none", "zip"))) == ["codec: 'zip' ('zip') is refused by allreduce.compression"]
    assert knob_outside_its_setting(Knob("x", ALLREDUCE, "x", "allreduce.x", (1, 2))) == [
        "x: sets allreduce.x, which is no policy setting"]


def test_the_version_matrix_quick_tests_name_files_that_exist():
    """tools/torch_matrix.py's quick leg lists test files by path; a move of a test must not
    silently drop it from every other torch release's run."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import torch_matrix
    finally:
        sys.path.remove(str(ROOT / "tools"))
    missing = [path for path in torch_matrix.QUICK_TESTS if not (ROOT / path).exists()]
    assert not missing, missing


def long_modules(root):
    """(path, lines) of every module under ``root`` longer than ``MAX_MODULE_LINES``."""
    return [(path, n) for path in sorted(root.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]


def long_classes(root):
    """{(path from ``root``'s parent, class name): lines} of every class under ``root`` longer than
    ``MAX_CLASS_LINES``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            lines = node.end_lineno - node.lineno + 1 if isinstance(node, ast.ClassDef) else 0
            if lines > MAX_CLASS_LINES:
                out[(path.relative_to(root.parent).as_posix(), node.name)] = lines
    return out


def crowded_packages(root):
    """(folder, modules) of every folder under ``root`` (itself included) holding more than
    ``MAX_PACKAGE_MODULES`` modules on its own level."""
    folders = [root] + sorted(path for path in root.rglob("*") if path.is_dir())
    return [(folder, n) for folder in folders if (n := len(list(folder.glob("*.py")))) > MAX_PACKAGE_MODULES]


def test_no_module_holds_several_modules_worth():
    found = [f"{path.relative_to(ROOT)}: {n} lines" for path, n in long_modules(PACKAGE)]
    assert not found, f"modules over {MAX_MODULE_LINES} lines (split them by idea):\n" + "\n".join(found)


def test_no_room_holds_several_rooms_worth():
    found = [f"{folder.relative_to(ROOT)}: {n} modules" for folder, n in crowded_packages(PACKAGE)]
    assert not found, f"folders over {MAX_PACKAGE_MODULES} modules (group them into rooms):\n" + "\n".join(found)


def test_no_class_holds_several_classes_worth():
    found = long_classes(PACKAGE)
    new = [f"{path}: {name}, {n} lines" for (path, name), n in found.items() if (path, name) not in OVER_THE_LIMIT]
    assert not new, f"classes over {MAX_CLASS_LINES} lines (move an idea out):\n" + "\n".join(new)
    back_under = sorted(OVER_THE_LIMIT - set(found))
    assert not back_under, f"back under {MAX_CLASS_LINES} lines, take them off OVER_THE_LIMIT: {back_under}"


def test_the_size_rules_catch_what_they_are_about(tmp_path):
    """A module one line past the limit and a class one line past it are found; ones at the limit
    are not."""
    def body(lines):
        return "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    (tmp_path / "big.py").write_text("class Big:\n" + body(MAX_CLASS_LINES + 1) + "\n" * MAX_MODULE_LINES)
    (tmp_path / "small.py").write_text("class Small:\n" + body(MAX_CLASS_LINES))
    (tmp_path / "edge.py").write_text("\n" * MAX_MODULE_LINES)
    assert [path.name for path, _ in long_modules(tmp_path)] == ["big.py"]
    assert long_classes(tmp_path) == {(f"{tmp_path.name}/big.py", "Big"): MAX_CLASS_LINES + 1}


def test_the_room_size_rule_catches_what_it_is_about(tmp_path):
    """A folder one module past the limit is found, wherever it sits; one at the limit is not."""
    for folder, modules in ((tmp_path, MAX_PACKAGE_MODULES), (tmp_path / "crowded", MAX_PACKAGE_MODULES + 1)):
        folder.mkdir(exist_ok=True)
        for i in range(modules - 1):
            (folder / f"m{i}.py").write_text("")
        (folder / "__init__.py").write_text("")
    assert crowded_packages(tmp_path) == [(tmp_path / "crowded", MAX_PACKAGE_MODULES + 1)]
