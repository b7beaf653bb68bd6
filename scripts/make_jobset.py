"""Renders a GKE JobSet that runs Decoupled DiLoCo (one slice or GPU node group per learner,
one CPU syncer); the logic and the flags are in `diloco.deploy.jobset`.

  python scripts/make_jobset.py --name=dd-2b --image=IMAGE --store=gs://BUCKET/dd-2b \\
      --config=configs/decoupled.py:gemma_2b --learners=8 --tpu_type=v5p-128 [--output=FILE]

Without --output (or with --dry_run) only the YAML goes to stdout, so
`... | kubectl apply -f -` works. docs/scale_out.md explains the choices.
"""

from absl import app, flags

from diloco.deploy import jobset


def _main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  return jobset.run(flags.FLAGS)


if __name__ == "__main__":
  jobset.define_flags(flags.FLAGS)  # here, not at import: tests import the module next to main
  app.run(_main)
