"""Cluster placement: the deploy config (``config``: ``DeployConfig``, one YAML for ``weightsync run``,
deploy/ manifests and ``deploy/render.py``) and where its actors land (``placement``: custom resources,
the transport chosen from where trainers and engines sit)."""
