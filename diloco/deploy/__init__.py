"""How processes reach machines: GKE JobSets and the accelerators of a host."""
