"""The project's own error types for bad configuration and bad documents, used by every package."""


class ConfigError(ValueError):
  """A configuration value is invalid; the message names the field."""


class DocumentError(ConfigError):
  """A document read back from disk (an export, a run config, a checkpoint's meta) is not what
  its writer would have written; the message names the file and the field.

  A ConfigError, so that every command's one-line error path prints it as it prints a bad flag.
  """

  def __init__(self, file: str, field: str, detail: str):
    self.file, self.field, self.detail = file, field, detail
    super().__init__(f"{file}: {field}: {detail}" if field else f"{file}: {detail}")
