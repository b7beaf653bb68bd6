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
  imported = _imports("learner")
  assert not {n for n in imported if "syncer" in n or "policy" in n or "runtime" in n}
  assert "diloco.transport" in imported


def test_syncer_does_not_know_the_learner():
  imported = _imports("syncer")
  assert not {n for n in imported if "learner" in n or "train_step" in n or n.startswith("jax")}
