"""Mutation testing of ``enjoyln check``: seeded mutations of checked folds, each with the verdict a sound gate owes it."""
