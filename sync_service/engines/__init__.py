"""Rollout-engine adapters (implementations of ``protocols.interfaces.EngineAdapter``)."""
