"""Export a run's model for other tools: `diloco export --workdir=RUN --format=hf`.

`--format=hf` writes a folder that Hugging Face transformers loads as Gemma 3
(`AutoModelForCausalLM.from_pretrained(OUT)`, and `AutoTokenizer` where the run's tokenizer
can be expressed; `diloco.artifacts.hf_format`) at --out (default WORKDIR/hf: the export
folder's own config.json is the diloco safetensors config). A model with features Gemma 3
lacks (MoE, no QK-norm, a custom architecture, ...) is refused, naming all of them.
`--format=safetensors` adds model.safetensors and config.json to the export folder itself:
the same tensors as the Orbax export under their "/"-joined names (e.g. "layers/0/attn/q_DNH")
and a config.json with the model's fields, the vocabulary size and the tokenizer file's name
(copied into the export folder), so that a reader without JAX (`safetensors.numpy.load_file`,
PyTorch) can load the model; `export.save(..., safetensors=True)` writes the same two files at
the end of a run.

Flags: --workdir (a run or an export folder), --format (hf | safetensors), --out,
--max_shard_size (e.g. "5GB", "500MB": larger weights are split into shards),
--overwrite (replace an earlier export's --out: only a folder whose manifest lists every file
in it), --trust_export_code. An --out that is, holds or lies inside the run (but for its own
WORKDIR/hf) or its store, or is a symbolic link, is refused.
"""

from __future__ import annotations

import os
import re

from absl import flags

from diloco import documents
from diloco.artifacts import export, hf_format
from diloco.cli import command
from diloco.errors import ConfigError

FORMATS = ("hf", "safetensors")
FLAGS = flags.FlagValues()
flags.DEFINE_string("workdir", None, "The run's workdir, or an export folder.", flag_values=FLAGS)
flags.DEFINE_string("format", "hf", f"What to write: {' | '.join(FORMATS)}.", flag_values=FLAGS)
flags.DEFINE_string("out", None, "The folder to write (--format=hf); default WORKDIR/hf.",
                    flag_values=FLAGS)
flags.DEFINE_string("max_shard_size", "5GB", "Largest weights file (--format=hf), e.g. 5GB, "
                    "500MB, 2GiB or a number of bytes; larger weights are sharded.",
                    flag_values=FLAGS)
flags.DEFINE_bool("overwrite", False, "Replace an earlier export's --out folder (only files "
                  "its manifest lists).", flag_values=FLAGS)
command.define_trust_flag(FLAGS)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
  """Bytes of a size such as "5GB" (powers of 10), "2GiB" (powers of 2) or "1000"."""
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text or "")
  if not match or match.group(2).upper() not in _UNITS:
    raise ConfigError(f"--max_shard_size: {text!r} is not a size such as 5GB, 500MB or 2GiB")
  size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
  if size < 1:
    raise ConfigError(f"--max_shard_size: must be at least 1 byte, got {text!r}")
  return size


def to_safetensors(workdir: str, trust_code: bool) -> None:
  """Adds model.safetensors and config.json to the export of `workdir` (a run or an export)."""
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


def _export() -> None:
  if FLAGS.format not in FORMATS:
    raise ConfigError(f"--format: must be one of {', '.join(FORMATS)}, got {FLAGS.format!r}")
  if not FLAGS.workdir:
    raise ConfigError("--workdir is required: a run's workdir or an export folder")
  if FLAGS.format == "safetensors":
    if FLAGS.out:
      raise ConfigError("--out: --format=safetensors writes into the export folder itself")
    to_safetensors(FLAGS.workdir, FLAGS.trust_export_code)
    return
  max_shard = parse_size(FLAGS.max_shard_size)
  found = export.export_dir(os.path.abspath(FLAGS.workdir))
  if found is None:
    raise ConfigError(f"--workdir: {FLAGS.workdir!r} holds no export "
                      f"({export.EXPORT_DIR}/{export.META_FILE})")
  out = FLAGS.out or hf_format.default_out(found)
  if os.path.abspath(out) == os.path.abspath(found):
    raise ConfigError(f"--out: {out!r} is the export folder itself; its config.json is the "
                      "diloco safetensors config, so write the Hugging Face folder elsewhere")
  store = _local_store(hf_format.run_of(found))
  if store:
    hf_format.check_apart(out, store, "the run's store")
  files = hf_format.write(found, out, max_shard, trust_code=FLAGS.trust_export_code,
                          overwrite=FLAGS.overwrite)
  weights = sum(f.endswith(".safetensors") for f in files)
  print(f"wrote a Hugging Face Gemma 3 folder to {out} ({weights} weights file(s); "
        f"{', '.join(f for f in files if not f.endswith('.safetensors'))})", flush=True)


def _local_store(run: str) -> str | None:
  """The run's store folder when it is on this filesystem (its config.json's store.root, else
  RUN/store), None for a gs:// store or a folder that is no run."""
  config = os.path.join(run, "config.json")
  if not os.path.isfile(config):
    return None
  doc = documents.obj(documents.read(config), config)
  group = documents.obj(doc.get("store", {}), config, "store")
  root = documents.fields(group, {"root": documents.Field(str, required=False)}, config,
                          "store.").get("root") or os.path.join(run, "store")
  return None if "://" in root else root


def main(argv: list[str]) -> None:
  """`argv[0]` is the program name; the rest are this command's flags (module docstring)."""
  command.run(FLAGS, argv, _export)


if __name__ == "__main__":
  command.app_run(main)
