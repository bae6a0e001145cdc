"""Sweeps: many trainings of one config searched by Optuna (space, study, trials)."""
