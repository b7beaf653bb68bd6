"""The `diloco` command: training and the tools around a run."""
