"""The package's import structure: layers that only import downwards, no cycles between folders,
one name per module, and a learner and a syncer that meet only through the transport."""

import ast
import functools
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
  """It takes the `sync` group (SyncConfig, declared beside the policy), never a decision."""
  imported = _imports("learner/learner") - {"diloco.sync.policy", "diloco.sync.policy.SyncConfig"}
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
  from diloco.distributed import hosts, learner_link

  methods = ["heartbeat", "deliver", "latest", "latest_version", "wait_for", "count_download"]
  for cls in (transport.InMemoryTransport, learner_link.LearnerStoreLink, hosts.AgreedLink):
    for name in methods:
      want = inspect.signature(getattr(transport.LearnerTransport, name))
      got = inspect.signature(getattr(cls, name))
      assert list(got.parameters) == list(want.parameters), (cls.__name__, name, got)


def test_the_run_config_is_a_learner_config_field_by_field():
  """`LearnerConfig` names every group a learner reads with its type (no `Any`): the run's
  `Config` has each group, and each group each field, with the same annotation."""
  import dataclasses
  import typing

  from diloco.config import run_config
  from diloco.learner import learner

  def annotations(cls):
    return typing.get_type_hints(cls) if not dataclasses.is_dataclass(cls) else {
        f.name: f.type for f in dataclasses.fields(cls)}

  config_groups = {f.name: f.type for f in dataclasses.fields(run_config.Config)}
  for group, kind in typing.get_type_hints(learner.LearnerConfig).items():
    assert kind is not typing.Any, group
    if group == "seed":
      assert config_groups[group] in (int, "int")
      continue
    have = annotations(getattr(run_config, config_groups[group])
                       if isinstance(config_groups[group], str) else config_groups[group])
    for name, want in annotations(kind).items():
      got = have[name]
      assert (got if isinstance(got, str) else got.__name__) == (
          want if isinstance(want, str) else want.__name__), (group, name)


@functools.cache  # one parse of the package for every test here (callers do not mutate it)
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


def _assert_acyclic(graph, what):
  """Depth-first search of {node: nodes it imports}; fails naming the first cycle found."""
  state = {}

  def visit(node, path):
    state[node] = "open"
    for dep in sorted(graph.get(node, ())):
      if state.get(dep) == "open":
        raise AssertionError(f"{what} cycle: " + " -> ".join(path + [node, dep]))
      if dep not in state:
        visit(dep, path + [node])
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [])


def test_the_package_has_no_import_cycles():
  _assert_acyclic(_module_graph(), "import")


def test_the_store_is_a_room_of_its_own():
  """`diloco.distributed.store` is the on-disk layout, below the links and processes that use
  it: it imports nothing else of `diloco.distributed`, and no store module lives beside them."""
  graph = _module_graph()
  for module, deps in graph.items():
    if module.startswith("diloco.distributed.store"):
      above = [d for d in deps if d.startswith("diloco.distributed.")
               and not d.startswith("diloco.distributed.store")]
      assert not above, (module, above)
  beside = os.listdir(os.path.join(PACKAGE, "distributed"))
  assert not [n for n in beside if n.startswith("store_") or n in (
      "blob_io.py", "entry_check.py", "lease.py", "payload_box.py", "merged_versions.py")]


def test_the_model_does_not_import_the_run_configuration():
  graph = _module_graph()
  for module, deps in graph.items():
    if module.startswith("diloco.model"):
      assert "diloco.config.run_config" not in deps, module


def test_modules_are_imported_normally():
  """Code is imported by name, never executed from a path behind Python's back: the only
  loaders by path are the two that take a user's file (a config file, and the module a field
  names: `model.module`, `log.hooks`)."""
  root = os.path.dirname(PACKAGE)
  allowed = {os.path.join("diloco", "config", "files.py"), os.path.join("diloco", "user_code.py")}
  tricks = ("spec_from_file_location", "module_from_spec", "sys.modules[", "SourceFileLoader")
  found = []
  for rel in _python_files():
    if rel not in allowed and rel != os.path.join("tests", "imports_test.py"):
      with open(os.path.join(root, rel), encoding="utf-8") as f:
        text = f.read()
      found += [f"{rel}: {t}" for t in tricks if t in text]
  assert not found, found


# The layers of the package, lowest first; a unit is a top-level module or a folder of `diloco`.
# A module may import its own layer's units (without a cycle between folders) and the layers
# below, never one above, deferred imports included. Why each layer sits where it does:
# - the vocabulary (errors, config rules, document readers, fragments, deliveries, transport
#   messages, the loader of a user's code) is imported by all and imports nothing of the package but
#   itself;
# - `outer` (the syncer's NumPy math), `model` and `programs` (readers of compiled programs)
#   need only the vocabulary;
# - `train` (the substrate: mesh, state, step, optimiser, data) builds on the model, and
#   `observe` (metrics, trackers, accounting) on nothing above the vocabulary;
# - `sync` (policy and syncer) takes the `outer` math, and `artifacts` (export, trained model)
#   the model and train state;
# - `learner` uses the substrate, an export to start from and the `sync` group, never the
#   syncer; `sim` drives the very same policy on a virtual clock;
# - `config` composes the groups declared beside their owners below it, so that no owner
#   imports the whole configuration;
# - the runtimes (`runtime`, `distributed`, `deploy`) put learners and syncers together from a
#   Config; `cli` (and the `main`/`__main__` entry points) parse flags and call them.
LAYERS = (
    {"errors", "settings", "documents", "fragments", "delivery", "transport", "user_code"},
    {"outer", "model", "programs"},
    {"train", "observe"},
    {"sync", "artifacts"},
    {"learner", "sim"},
    {"config"},
    {"runtime", "distributed", "deploy"},
    {"cli", "main", "__main__", "api"},
)


def _unit(module):
  """The layer unit of a module: `diloco.sync.policy` -> `sync`, `diloco.errors` -> `errors`."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else parts[0]


def _layer_of():
  return {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def test_every_unit_of_the_package_has_a_layer():
  layer = _layer_of()
  units = {_unit(m) for m in _module_graph()} - {"diloco"}
  assert not units - set(layer), f"add to LAYERS: {sorted(units - set(layer))}"
  assert not set(layer) - units, f"gone from the package: {sorted(set(layer) - units)}"


def test_no_import_runs_upward():
  layer = _layer_of()
  upward = []
  for module, deps in sorted(_module_graph().items()):
    for dep in sorted(deps):
      if dep == "diloco" or module == "diloco":
        continue
      if layer[_unit(dep)] > layer[_unit(module)]:
        upward.append(f"{module} -> {dep}")
  assert not upward, upward


def test_learner_and_sync_do_not_import_the_run_configuration():
  """They take the groups they read (SyncConfig, OuterConfig, ...), so the configuration that
  composes every group can import them without a cycle."""
  for module, deps in _module_graph().items():
    if _unit(module) in ("learner", "sync", "sim"):
      assert not {d for d in deps if _unit(d) == "config"}, module


def test_no_cycles_between_folders():
  edges = {}
  for module, deps in _module_graph().items():
    for dep in deps:
      if _unit(dep) != _unit(module):
        edges.setdefault(_unit(module), set()).add(_unit(dep))
  _assert_acyclic(edges, "folder")


def test_no_two_modules_share_a_name():
  """One name per concept: a module's basename says which one (`__init__` and `__main__` are
  Python's)."""
  seen = {}
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py") and name not in ("__init__.py", "__main__.py"):
        seen.setdefault(name, []).append(os.path.relpath(os.path.join(folder, name), PACKAGE))
  assert not {n: p for n, p in seen.items() if len(p) > 1}


# The vocabulary every layer imports, and `main.py`, which keeps `python -m diloco.main` working;
# everything else lives in the subpackage named for its concept.
# The vocabulary, the entry points (main, __main__) and the public API (api: `import diloco`);
# user_code is vocabulary too: the model (`model.module`) and the hooks (`log.hooks`), two
# layers apart, import a user's module through it.
TOP_LEVEL = {"__init__.py", "__main__.py", "api.py", "delivery.py", "documents.py", "errors.py",
             "fragments.py", "main.py", "settings.py", "transport.py", "user_code.py"}


def test_the_top_level_holds_only_the_vocabulary():
  found = {n for n in os.listdir(PACKAGE) if n.endswith(".py")}
  assert found == TOP_LEVEL, f"new top-level modules {sorted(found - TOP_LEVEL)}: move them " \
      "into the subpackage of their concept (docs/architecture.md)"


def test_modules_and_classes_stay_readable():
  """A module past 500 lines or a class past 350 holds two jobs: split it by job."""
  big = []
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        with open(path, encoding="utf-8") as f:
          text = f.read()
        rel = os.path.relpath(path, os.path.dirname(PACKAGE))
        if len(text.splitlines()) > 500:
          big.append(f"{rel}: {len(text.splitlines())} lines")
        big += [f"{rel}: class {node.name} {node.end_lineno - node.lineno + 1} lines"
                for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ClassDef)
                and node.end_lineno - node.lineno + 1 > 350]
  assert not big, big


def _python_files():
  root = os.path.dirname(PACKAGE)
  for top in ("diloco", "experiments", "scripts", "tests", "configs"):
    for folder, _, files in os.walk(os.path.join(root, top)):
      for name in sorted(files):
        if name.endswith(".py"):
          yield os.path.relpath(os.path.join(folder, name), root)


def test_the_projects_modules_are_imported_under_their_own_name():
  """An alias may qualify a name (`state as train_state`) but never replace it (`run_config as
  config_lib`): a reader who greps a module's name finds every use of it. Other projects'
  conventional aliases (`numpy as np`) are theirs to name."""
  root = os.path.dirname(PACKAGE)
  local = {n[:-3] for n in os.listdir(os.path.join(root, "tests")) if n.endswith(".py")}

  def ours(module, level=0):
    return level > 0 or module.split(".")[0] in ("diloco", "experiments") or module in local

  replaced = []
  for rel in _python_files():
    with open(os.path.join(root, rel), encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        for a in node.names:
          first_party = (ours(node.module or "", node.level) if isinstance(node, ast.ImportFrom)
                         else ours(a.name))
          if a.asname and first_party and a.name.split(".")[-1] not in a.asname:
            replaced.append(f"{rel}:{node.lineno}: {a.name} as {a.asname}")
  assert not replaced, replaced


# What a checkout may hold besides text: the experiments' plots and the device runs' compiled
# programs (gzipped HLO), both generated by the project's own commands. Packages come from PyPI,
# never from a file in the repository.
BINARY_SUFFIXES = (".png", ".hlo.txt.gz")


def test_the_repository_tracks_no_packages_or_stray_binaries():
  import subprocess
  root = os.path.dirname(PACKAGE)
  tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True,
                           ).stdout.decode().split("\0")
  stray = []
  for rel in filter(None, tracked):
    path = os.path.join(root, rel)
    if not os.path.isfile(path) or rel.endswith(BINARY_SUFFIXES):
      continue
    with open(path, "rb") as f:
      head = f.read(8192)
    if rel.endswith((".whl", ".tar.gz", ".zip", ".so")) or b"\0" in head:
      stray.append(rel)
  assert not stray, f"binary files tracked (install them from a registry instead): {stray}"
