"""The learner and the syncer never import each other: they meet only through the transport."""

import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "diloco")


def _imports(module):
  with open(os.path.join(PACKAGE, module + ".py")) as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
    elif isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
  return names


def test_learner_does_not_know_the_syncer():
  imported = _imports("learner/learner")
  assert not {n for n in imported if "syncer" in n or "policy" in n or "runtime" in n}
  assert "diloco.transport" in imported


def test_the_learner_loop_does_not_know_the_syncer_or_a_runtime():
  """The loop every runtime shares: it drives a learner through hooks, never a runtime."""
  imported = _imports("learner/loop")
  assert not {n for n in imported if "syncer" in n or "policy" in n or "runtime" in n
              or "distributed" in n}
  assert "diloco.learner.learner" in imported


def test_syncer_does_not_know_the_learner():
  imported = _imports("sync/syncer")
  assert not {n for n in imported
              if "learner" in n or n.startswith("diloco.train") or n.startswith("jax")}


def test_every_transport_implements_the_learner_protocol():
  """The in-memory transport and both store links offer the learner's Protocol, same signatures."""
  import inspect

  from diloco import transport
  from diloco.distributed import hosts, store_transport

  methods = ["heartbeat", "deliver", "latest", "latest_version", "wait_for", "count_download"]
  for cls in (transport.InMemoryTransport, store_transport.LearnerStoreLink, hosts.AgreedLink):
    for name in methods:
      want = inspect.signature(getattr(transport.LearnerTransport, name))
      got = inspect.signature(getattr(cls, name))
      assert list(got.parameters) == list(want.parameters), (cls.__name__, name, got)


def _module_graph():
  """{module: modules of the package it imports}, anywhere in its file (deferred imports too).
  `from a import b` counts as importing `a.b` when that is a module, else `a`."""
  root = os.path.dirname(PACKAGE)
  modules = {}
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(folder, name), root)[:-3].replace(os.sep, ".")
        modules[rel.removesuffix(".__init__")] = os.path.join(folder, name)
  graph = {}
  for module, path in modules.items():
    with open(path) as f:
      tree = ast.parse(f.read())
    edges = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("diloco"):
        for alias in node.names:
          full = f"{node.module}.{alias.name}"
          edges.add(full if full in modules else node.module)
      elif isinstance(node, ast.Import):
        edges.update(a.name for a in node.names if a.name in modules)
    graph[module] = edges - {module}
  return graph


def test_the_package_has_no_import_cycles():
  graph = _module_graph()
  state = {}

  def visit(module, path):
    state[module] = "open"
    for dep in sorted(graph.get(module, ())):
      if state.get(dep) == "open":
        raise AssertionError("import cycle: " + " -> ".join(path + [module, dep]))
      if dep not in state:
        visit(dep, path + [module])
    state[module] = "done"

  for module in sorted(graph):
    if module not in state:
      visit(module, [])


def test_the_model_does_not_import_the_run_configuration():
  graph = _module_graph()
  for module, deps in graph.items():
    if module.startswith("diloco.model"):
      assert "diloco.config.run_config" not in deps, module


def test_modules_are_imported_normally():
  """Code is imported by name, never executed from a path behind Python's back: the only
  loaders by path are the two that take a user's file (a config file and a model module)."""
  root = os.path.dirname(PACKAGE)
  allowed = {os.path.join("diloco", "config", "files.py"), os.path.join("diloco", "model",
                                                                    "registry.py")}
  tricks = ("spec_from_file_location", "module_from_spec", "sys.modules[", "SourceFileLoader")
  found = []
  for top in ("diloco", "experiments", "scripts", "tests", "configs"):
    for folder, _, files in os.walk(os.path.join(root, top)):
      for name in files:
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, root)
        if name.endswith(".py") and rel not in allowed and rel != os.path.join(
            "tests", "imports_test.py"):
          with open(path, encoding="utf-8") as f:
            text = f.read()
          found += [f"{rel}: {t}" for t in tricks if t in text]
  assert not found, found
