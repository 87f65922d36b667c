"""The coordinator: builds the sync plan once, validates it against every engine, drives
begin / commit / abort across trainer shards and rollout engines, tracks versions and members."""

from sync_service.coordinator.driver import Coordinator
from sync_service.coordinator.planning import PlanMismatchError, build_sync_plan, validate_plan

__all__ = ["Coordinator", "PlanMismatchError", "build_sync_plan", "validate_plan"]
