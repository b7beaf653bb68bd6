"""`diloco jobset`: a GKE JobSet manifest that runs a multi-process Decoupled DiLoCo run, one
TPU slice or GPU node group per learner and one CPU syncer (`diloco.deploy.jobset`; the choices
are in docs/scale_out.md). `diloco slurm` is its counterpart for SLURM clusters.

  diloco jobset --name=dd-2b --image=IMAGE --store=gs://BUCKET/dd-2b \\
      --config=configs/decoupled.py:gemma_2b --learners=8 --tpu_type=v5p-128 [--output=FILE]

Without --output (or with --dry_run) only the YAML goes to stdout, so
`diloco jobset ... | kubectl apply -f -` works. A bad flag is one line, exit status 2.
"""

from __future__ import annotations

import sys

from diloco.deploy import jobset


def main(argv: list[str]) -> None:
  """`argv[0]` is the program name; the rest are this command's flags (module docstring)."""
  sys.exit(jobset.main(argv[1:], prog=argv[0]))
