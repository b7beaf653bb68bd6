"""Add model.safetensors and config.json to a run's export:
`python -m diloco.cli.to_safetensors --workdir=RUN`.

The same tensors as the Orbax export under their "/"-joined names (e.g.
"layers/0/attn/q_DNH"), and a config.json with the model's fields, the vocabulary size and
the tokenizer file's name (copied into the export folder), so that a reader without JAX
(`safetensors.numpy.load_file`, PyTorch) can load the model. `export.save(...,
safetensors=True)` writes the same two files at the end of a run.

Flags: --workdir (a run or an export folder), --trust_export_code (convert an export whose
model names code to import; see `diloco.cli.command.define_trust_flag`).
"""

from __future__ import annotations

import os

from absl import flags

from diloco.artifacts import export
from diloco.cli import command
from diloco.errors import ConfigError

FLAGS = flags.FlagValues()
flags.DEFINE_string("workdir", None, "The run's workdir, or an export folder.", flag_values=FLAGS)
command.define_trust_flag(FLAGS)


def convert(workdir: str | None, trust_code: bool) -> None:
  """Adds model.safetensors and config.json to the export of `workdir` (a run or an export)."""
  if not workdir:
    raise ConfigError("--workdir is required: a run's workdir or an export folder")
  found = export.export_dir(workdir)
  if found is None:
    raise ConfigError(f"--workdir: {workdir!r} holds no export "
                      f"({export.EXPORT_DIR}/{export.META_FILE})")
  # Nothing here builds the model, but the copy is made for other readers: one that names
  # code to import is passed on only by a user who trusts it.
  meta_file = os.path.join(found, export.META_FILE)
  export.refuse_code(export.read_model(export.read_meta(found)["model"], meta_file), meta_file,
                     trust_code)
  params, meta = export.load(found)
  for path in export.write_safetensors(found, params, meta):
    print(f"wrote {path}")


def _convert() -> None:
  convert(FLAGS.workdir, FLAGS.trust_export_code)


def main(argv: list[str]) -> None:
  """`argv[0]` is the program name; the rest are this command's flags (module docstring)."""
  command.run(FLAGS, argv, _convert)


if __name__ == "__main__":
  command.app_run(main)
