"""Finding plans: a shared evaluator and objectives, greedy skipping, Optuna studies."""
