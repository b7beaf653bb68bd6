"""The run's configuration: the groups composed, validated, read from files."""
