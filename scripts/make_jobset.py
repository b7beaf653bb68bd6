"""`diloco jobset` under its older name: renders a GKE JobSet that runs Decoupled DiLoCo (one
slice or GPU node group per learner, one CPU syncer); the flags and the logic are in
`diloco.deploy.jobset`, the command in `diloco.cli.jobset_manifest`.

  python scripts/make_jobset.py --name=dd-2b --image=IMAGE --store=gs://BUCKET/dd-2b \\
      --config=configs/decoupled.py:gemma_2b --learners=8 --tpu_type=v5p-128 [--output=FILE]
"""

import sys

from diloco.cli import jobset_manifest

if __name__ == "__main__":
  jobset_manifest.main(["make_jobset.py", *sys.argv[1:]])
