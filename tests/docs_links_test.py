"""The README and docs/ stand on their own: every relative link and every repository path they
name exists in the repository, and a `file.py::name` reference names something defined there."""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# A path in backticks is checked when it starts at one of these (paths are written from the
# repository's root); run outputs (runs/, WORKDIR/) and placeholders are not repository files.
TOP = ("diloco/", "experiments/", "configs/", "scripts/", "tests/", "docs/", ".ci/")
TOP_FILES = ("README.md", "BUILD_NOTES.md", "setup.py", "pyproject.toml", "Dockerfile")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PLACEHOLDER = re.compile(r"[<>*{}$]|\.\.\.|\bNAME\b|\bSTEP\b|/N\b")


def _links(text: str) -> list[str]:
  return [t for t in LINK.findall(text)
          if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def _paths(text: str) -> list[str]:
  """Repository paths named in code spans: `diloco/sync/syncer.py`, `configs/dp.py:tiny`,
  `tests/x_test.py::test_y`, `experiments/sweep/` (the first word of a span only)."""
  found = []
  for span in CODE.findall(text):
    word = span.split()[0].rstrip(".,;:)") if span.split() else ""
    if (word.startswith(TOP) or word in TOP_FILES) and not PLACEHOLDER.search(word):
      found.append(word)
  return found


def _split(reference: str) -> tuple[str, str | None]:
  """(path, symbol) of `path::symbol`; a config file's `:preset` is dropped."""
  path, _, symbol = reference.partition("::")
  if not symbol and re.search(r"\.py:[\w.]+$", path):
    path = path.rsplit(":", 1)[0]
  return path, symbol.split("(")[0].split(".")[0] or None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve_inside_the_repository(doc):
  text = doc.read_text(encoding="utf-8")
  bad = []
  for target in _links(text):
    path = (doc.parent / target.split("#")[0]).resolve()
    if not path.is_relative_to(REPO) or not path.exists():
      bad.append(target)
  assert not bad, f"{doc.name}: links that do not resolve in the repository: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_named_paths_and_symbols_exist(doc):
  text = doc.read_text(encoding="utf-8")
  bad = []
  for reference in _paths(text):
    path, symbol = _split(reference)
    file = REPO / path
    if not file.exists():
      bad.append(reference)
    elif symbol and file.is_file() and not re.search(
        rf"^\s*(def|class)\s+{re.escape(symbol)}\b|^{re.escape(symbol)}\s*[:=]",
        file.read_text(encoding="utf-8"), re.MULTILINE):
      bad.append(reference)
  assert not bad, f"{doc.name}: named paths or symbols that do not exist: {bad}"


def test_the_decisions_index_lists_every_entry_of_every_topic():
  folder = REPO / "docs" / "decisions"
  index = (folder / "README.md").read_text(encoding="utf-8")
  listed = set(re.findall(r"^- \[.+\]\(([a-z_]+\.md#[\w-]+)\)$", index, re.M))
  entries = set()
  for topic in folder.glob("*.md"):
    if topic.name != "README.md":
      for title in re.findall(r"^## (.+)$", topic.read_text(encoding="utf-8"), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        entries.add(f"{topic.name}#{slug}")
  assert listed == entries, (sorted(listed - entries), sorted(entries - listed))


def test_the_checks_find_what_they_should():
  text = ("see [design](design.md#2-the-algorithm), [web](https://x.org), `diloco/sync/syncer.py`, "
          "`configs/dp.py:tiny`, `tests/outer_test.py::test_rda`, `runs/x/`, `<WORKDIR>/a`, "
          "`diloco/{a,b}.py`")
  assert _links(text) == ["design.md#2-the-algorithm"]
  assert _paths(text) == [
      "diloco/sync/syncer.py", "configs/dp.py:tiny", "tests/outer_test.py::test_rda"]
  assert _split("configs/dp.py:tiny") == ("configs/dp.py", None)
  assert _split("tests/outer_test.py::test_rda") == ("tests/outer_test.py", "test_rda")
  assert _split("diloco/sync/syncer.py::Syncer.tick") == ("diloco/sync/syncer.py", "Syncer")


def test_ci_runs_the_readmes_test_command_and_every_marker_phase():
  """CI runs each pytest phase of the README's test command, in the same order, and the phases'
  markers together select every test once (no test falls between them)."""
  readme = (REPO / "README.md").read_text()
  command = next(line for line in readme.splitlines() if "python -m pytest" in line)
  phases = [p.strip() for p in command.split("&&") if "python -m pytest" in p]
  ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
              if line.strip().startswith("python -m pytest")]
  assert ci_lines[:len(phases)] == phases
  markers = [re.search(r'pytest .* -m (?:"([^"]+)"|(\w+))', p).group(1, 2) for p in phases]
  selections = [quoted or bare for quoted, bare in markers]
  # Every combination of the two markers lands in exactly one phase.
  for processes in (False, True):
    for gloo in (False, True):
      if gloo and not processes:
        continue  # a gloo test always starts processes
      hits = [s for s in selections
              if eval(s, {}, {"processes": processes, "gloo": gloo})]  # pylint: disable=eval-used
      assert len(hits) == 1, (processes, gloo, hits)
  for path in (REPO / "tests").glob("*_test.py"):
    text = path.read_text()
    if "pytest.mark.gloo" in text:
      assert "pytest.mark.processes" in text, path.name


# Outside documents (the brief's design and style files) and tracker numbers: the repository's
# own docs/design.md is what code and docs cite. Written so that this line does not match.
OUTSIDE = re.compile(r"\b(DESIGN|STYLE)\.md\b|\b[Ii]ssues? #?\d+\b|\.\./shared/")


def test_code_and_docs_cite_nothing_outside_the_repository():
  files = [REPO / "README.md", REPO / "BUILD_NOTES.md", *(REPO / "docs").glob("*.md")]
  for top in ("diloco", "experiments", "configs", "scripts", "tests"):
    files += (REPO / top).rglob("*.py")
    files += (REPO / top).rglob("*.md")
  found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
           for path in files for n, line in enumerate(path.read_text().splitlines(), 1)
           if OUTSIDE.search(line) and path != pathlib.Path(__file__).resolve()]
  assert found == []


def _setup_extras() -> dict[str, list[str]]:
  import ast
  setup = ast.parse((REPO / "setup.py").read_text())
  call = next(n for n in ast.walk(setup) if isinstance(n, ast.Call)
              and getattr(n.func, "id", None) == "setup")
  return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))


INSTALL = re.compile(r"pip install (?:-e )?\"?\.\[([\w,${}]+)\]")
NO_EXTRA = re.compile(r"\bno (GPU|CUDA|TPU|`cuda`|`tpu`) extra", re.IGNORECASE)


def test_one_install_story_every_extra_named_exists():
  """Every `pip install -e ".[...]"` that README, docs, scripts and CI name installs extras
  that setup.py has, and no document says a platform has none (docs once disagreed on GPUs)."""
  extras = _setup_extras()
  assert {"test", "cuda", "tpu", "gcs"} <= set(extras)
  files = [REPO / "README.md", REPO / "Dockerfile", REPO / ".ci" / "run",
           *(REPO / "docs").glob("*.md"), *(REPO / "scripts").glob("*.py")]
  named = 0
  for path in files:
    text = path.read_text()
    assert not NO_EXTRA.search(text), (path.name, NO_EXTRA.search(text).group(0))
    for group in INSTALL.findall(text):
      if "$" in group:  # the Dockerfile's build argument, checked by jobset_test
        continue
      named += 1
      assert set(group.split(",")) <= set(extras), (path.name, group)
  assert named >= 10
  assert INSTALL.findall('pip install -e ".[cuda,gcs]" and pip install ".[tpu]"') == [
      "cuda,gcs", "tpu"]


# `module.name` in a code span names something of the project's: a module's basename (diloco's,
# experiments' or scripts') and a name defined at its top level. Spans whose first word is a
# config group (`sync.period`) or whose second is a file suffix (`config.json`) are not modules.
REF = re.compile(r"([a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)(?=$|[\s(.,\[=])")
SUFFIXES = {"json", "jsonl", "md", "png", "py", "yaml", "txt", "gz", "csv", "safetensors", "npz",
            "npy", "sh", "model", "log", "out", "toml"}


def _top_level_names(path: pathlib.Path) -> set[str]:
  import ast
  names = set()
  for node in ast.parse(path.read_text(encoding="utf-8")).body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update(a.asname or a.name.split(".")[0] for a in node.names)
  return names


def _module_references(text: str, modules: set[str], groups: set[str]) -> list[tuple[str, str]]:
  found = []
  for span in CODE.findall(text):
    m = REF.match(span)
    if m and m.group(1) in modules and m.group(1) not in groups and m.group(2) not in SUFFIXES:
      found.append(m.group(1, 2))
  return found


def _project_modules() -> dict[str, list[pathlib.Path]]:
  modules = {}
  for top in ("diloco", "experiments", "scripts", "tests"):
    for path in (REPO / top).rglob("*.py"):
      if path.name not in ("__init__.py", "__main__.py"):
        modules.setdefault(path.stem, []).append(path)
  return modules


def _config_groups() -> set[str]:
  import dataclasses

  from diloco.config import run_config
  return {f.name for f in dataclasses.fields(run_config.Config)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_named_module_attributes_exist(doc):
  """`ownership.assign`, `merge.MERGE_METHODS`: a rename cannot leave the old name in a doc."""
  modules, groups = _project_modules(), _config_groups()
  bad = [f"{module}.{name}" for module, name in _module_references(
      doc.read_text(encoding="utf-8"), set(modules), groups)
         if not any(name in _top_level_names(p) for p in modules[module])]
  assert not bad, f"{doc.name}: module attributes that do not exist: {bad}"


DOTTED = re.compile(r"diloco(?:\.[A-Za-z_]\w*)+(?=$|[\s(,\[=])")


def _resolves(dotted: str) -> bool:
  """`diloco.sync.ownership.assign`: the longest importable prefix, then attributes."""
  import importlib
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    for name in parts[cut:]:
      if not hasattr(obj, name):
        return False
      obj = getattr(obj, name)
    return True
  return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_dotted_names_of_the_package_resolve(doc):
  spans = [m.group(0) for span in CODE.findall(doc.read_text(encoding="utf-8"))
           if (m := DOTTED.match(span)) and m.group(0).rsplit(".", 1)[1] not in SUFFIXES]
  bad = [s for s in spans if not _resolves(s)]
  assert not bad, f"{doc.name}: dotted names of the package that do not resolve: {bad}"


def test_the_module_reference_check_finds_what_it_should():
  text = "`ownership.assign`, `sync.period`, `config.json`, `syncer.Syncer.tick(...)`, `a b`, `syncer.x-y`"
  assert _module_references(text, {"ownership", "syncer", "config"}, {"sync"}) == [
      ("ownership", "assign"), ("syncer", "Syncer")]
  assert "assign" in _top_level_names(REPO / "diloco" / "sync" / "ownership.py")
  assert _resolves("diloco.sync.ownership.assign") and not _resolves("diloco.sync.syncer_shards")
  assert not _resolves("diloco.sync.ownership.gone")


def test_the_build_notes_stay_short():
  """BUILD_NOTES.md holds the current figures, one per row; their history is git's."""
  text = (REPO / "BUILD_NOTES.md").read_text(encoding="utf-8")
  assert len(text.split()) <= 2500, len(text.split())
  rows = [line for line in text.splitlines() if line.startswith("| ")]
  assert all(len(row) <= 700 for row in rows), max(rows, key=len)[:200]
