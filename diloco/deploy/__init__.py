"""How processes reach machines: GKE JobSets (`jobset`, a learner's nodes in `gke_nodes`) and
the accelerators of a host (`accelerators`)."""
