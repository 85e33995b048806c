"""Training: recipes, data, objectives, optimizer and schedules, checkpoints, the loop."""
