"""The training substrate one learner runs on: state created sharded (`state`), the jitted AdamW
step (`step`, `optim`), learner meshes (`mesh`), Grain data and tokenizers (`data`,
`tokenizers`), checkpoints (`checkpoint`), what each runtime builds per learner (`island`), and
the plain data-parallel baseline loop (`data_parallel`)."""
