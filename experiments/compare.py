"""`python -m experiments.compare` is `diloco compare` (diloco/cli/compare.py), kept for old
commands.

The comparison ships with the package so that it works outside the checkout:
`diloco compare WORKDIR... [--report_dir=DIR]` or `python -m diloco.cli.compare ...`.
"""

import sys

from diloco.cli.compare import compare, main  # noqa: F401  (the names experiments import)

if __name__ == "__main__":
  main(sys.argv)
