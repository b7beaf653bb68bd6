"""How processes reach machines: GKE JobSets (`jobset`, a learner's nodes in `gke_nodes`),
SLURM batch jobs (`slurm`; its config group is `diloco.config.slurm_config`) and the accelerators of a host
(`accelerators`)."""
