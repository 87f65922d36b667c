"""Integrations with training frameworks (optional extras): ``trl`` (TRL trainers, ``pip install weightsync[trl]``)."""
