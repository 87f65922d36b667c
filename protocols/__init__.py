"""Interfaces and wire types of weightsync. Imports neither Ray nor torch.distributed."""
