"""public_config: the resolved config as it may be written down (run.json, checkpoints, trackers),
every credential in a storage option redacted."""

from __future__ import annotations

from typing import Any

from harness.config.run import RunConfig

# Storage-option keys that hold credentials: never written to run.json, checkpoints or logs.
SECRET_KEYS = ("key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key",
               "aws_session_token", "session_token")


def public_config(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as JSON-able data with credentials in storage options redacted."""
    return _redact(cfg.model_dump(mode="json"))


def _redact(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: "<redacted>" if k.lower() in SECRET_KEYS and v is not None else _redact(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_redact(v) for v in tree]
    return tree

