"""setup.py declares what the code imports, and its `diloco` command runs the CLI."""

import ast
import importlib
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ("diloco", "scripts", "experiments", "configs")
OWN = {"diloco", "configs", "experiments", "scripts", "tests"}
# Modules whose whole job is an optional feature: they import its extra's packages at module
# level, and the rest of the package imports them only inside functions (checked below).
OPTIONAL_MODULES = {"diloco/artifacts/harness_model.py": "lm-eval"}


def _setup_kwargs() -> dict:
  """The literal keyword arguments of the `setup(...)` call in setup.py."""
  tree = ast.parse((REPO / "setup.py").read_text())
  call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
              and getattr(n.func, "id", None) == "setup")
  out = {}
  for kw in call.keywords:
    try:
      out[kw.arg] = ast.literal_eval(kw.value)
    except ValueError:
      pass  # e.g. long_description=open(...).read()
  return out


def _name(requirement: str) -> str:
  """The PEP 503 normalised distribution name of a requirement string."""
  return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def _lazy_nodes(tree: ast.AST) -> set[int]:
  """The ids of the nodes inside a function of `tree` (run only when it is called)."""
  return {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
          for n in ast.walk(f)}


def _imports() -> dict[str, tuple[str, bool]]:
  """{top-level module: (a file that imports it, whether any import of it is at module level)}
  for the third-party modules imported anywhere in the scanned directories."""
  found: dict[str, tuple[str, bool]] = {}
  for directory in SCANNED:
    for path in sorted((REPO / directory).rglob("*.py")):
      tree = ast.parse(path.read_text(), str(path))
      lazy = _lazy_nodes(tree)
      if str(path.relative_to(REPO)) in OPTIONAL_MODULES:
        lazy = {id(n) for n in ast.walk(tree)}
      for node in ast.walk(tree):
        if isinstance(node, ast.Import):
          names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
          names = [node.module]
        else:
          continue
        for top in {n.split(".")[0] for n in names}:
          if top in sys.stdlib_module_names or top in OWN:
            continue
          _, eager = found.get(top, ("", False))
          found[top] = (str(path.relative_to(REPO)), eager or id(node) not in lazy)
  return found


def test_every_imported_package_is_declared():
  kwargs = _setup_kwargs()
  required = {_name(r) for r in kwargs["install_requires"]}
  extras = {_name(r) for reqs in kwargs.get("extras_require", {}).values() for r in reqs}
  providers = importlib.metadata.packages_distributions()
  imports = _imports()
  assert {"jax", "yaml", "scipy", "etils", "ml_dtypes"} <= set(imports)  # the walk finds them
  missing = []
  for module, (where, eager) in sorted(imports.items()):
    dists = {_name(d) for d in providers.get(module, [module])}
    # A module-level import needs an install requirement; one inside a function (an optional
    # feature) may come from an extra instead.
    if not dists & (required if eager else required | extras):
      missing.append(f"{module} (imported by {where}; distributions {sorted(dists)})")
  assert not missing, "not declared in setup.py install_requires: " + ", ".join(missing)


def test_console_command_is_the_cli():
  (script,) = _setup_kwargs()["entry_points"]["console_scripts"]
  name, target = (s.strip() for s in script.split("="))
  module, function = target.split(":")
  assert name == "diloco"
  assert getattr(importlib.import_module(module), function) is importlib.import_module(
      "diloco.cli.commands").main
  # What pip's generated `diloco` script does: call it with argv[0] = "diloco".
  code = (f"import sys; from {module} import {function}; "
          f"sys.argv = ['diloco', '--config=configs/diloco.py:tiny', '--config_help=quorum']; "
          f"sys.exit({function}())")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        cwd=REPO, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "sync.quorum = 0  # K:" in proc.stdout


def test_optional_modules_are_imported_lazily_and_their_extras_declare_their_packages():
  """An optional feature's module is imported only inside functions anywhere in the package,
  so that `import diloco...` never needs its extra; the extra lists what it imports."""
  extras = _setup_kwargs()["extras_require"]
  providers = importlib.metadata.packages_distributions()
  for module_path, extra in OPTIONAL_MODULES.items():
    dotted = module_path[:-3].replace("/", ".")
    tree = ast.parse((REPO / module_path).read_text())
    tops = {n.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
            for n in (a.name for a in node.names)}
    tops |= {node.module.split(".")[0] for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module}
    third_party = {t for t in tops if t not in sys.stdlib_module_names and t not in OWN}
    declared = {_name(r) for r in extras[extra]}
    for top in third_party - {"jax", "numpy", "flax"}:
      assert {_name(d) for d in providers.get(top, [top])} & declared, (top, extra)
    for path in sorted((REPO / "diloco").rglob("*.py")):
      tree = ast.parse(path.read_text())
      lazy = _lazy_nodes(tree)
      for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) and node.module else [])
        if any(n == dotted or n.startswith(dotted + ".") for n in names):
          assert id(node) in lazy, f"{path} imports {dotted} at module level"
