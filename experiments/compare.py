"""`python -m experiments.compare` is `diloco compare` (diloco/compare.py), kept for old commands.

The comparison ships with the package so that it works outside the checkout:
`diloco compare WORKDIR... [--report_dir=DIR]` or `python -m diloco.compare ...`.
"""

from absl import app

from diloco.compare import compare, define_flags, main  # noqa: F401

if __name__ == "__main__":
  define_flags()
  app.run(main)
