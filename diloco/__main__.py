"""`python -m diloco` is the `diloco` command: training by default, and its subcommands."""

from diloco.cli.commands import main

main()
