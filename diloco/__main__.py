"""`python -m diloco` is the same as `python -m diloco.main`."""

from diloco.main import run_cli

run_cli()
