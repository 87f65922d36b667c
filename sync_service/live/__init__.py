"""Weight sync from inside a training process, over its live PEFT model (plain, DDP, FSDP2, expert parallel).

``attach_trainer(peft_model, ...)`` on every training rank returns an ``EndpointHandle``; the
coordinator (``WeightSync`` in the driver) takes the handles of all ranks as its trainers. See
``docs/integrate.md``.
"""

from sync_service.live.attach import AttachError, attach_trainer, build_endpoint
from sync_service.live.handle import EndpointHandle

__all__ = ["AttachError", "EndpointHandle", "attach_trainer", "build_endpoint"]
