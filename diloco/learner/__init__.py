"""A learner: its train step with fragment I/O, its one loop, its island."""
