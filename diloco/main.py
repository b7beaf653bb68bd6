"""`python -m diloco.main`, the training command as the docs and manifests spell it.

A shim: training lives in `diloco/cli/train.py`; this keeps the documented module name working.
"""

from diloco.cli.train import run_cli

if __name__ == "__main__":
  run_cli()
