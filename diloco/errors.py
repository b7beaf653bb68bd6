"""The project's own error type for bad configuration, shared by every package."""


class ConfigError(ValueError):
  """A configuration value is invalid; the message names the field."""
