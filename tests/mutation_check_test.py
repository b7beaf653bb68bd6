"""The mutation table (scripts/mutation_check.py) cannot rot: every mutant still names a check
that is in the package exactly once, and the tests that guard it exist."""

import os

import pytest
from script_import import import_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
mutation_check = import_script("mutation_check")


@pytest.mark.parametrize("mutant", mutation_check.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_deletes_a_check_that_is_there_once(mutant):
  with open(os.path.join(ROOT, mutant.path)) as f:
    source = f.read()
  assert source.count(mutant.old) == 1, mutant.name
  assert mutant.new != mutant.old
  assert all(os.path.isfile(os.path.join(ROOT, t)) for t in mutant.tests)


def test_mutant_names_are_unique():
  names = [m.name for m in mutation_check.MUTANTS]
  assert len(names) == len(set(names))
