"""The one rule for every HTTP server journeyman starts (``serve``, ``ui``): nothing beyond
loopback without a token. Light on purpose: ``journeyman ui`` imports it without the trainer."""

from __future__ import annotations

import ipaddress

from journeyman.errors import ConfigError

__all__ = ["check_bind"]


def check_bind(host: str, token: str | None, what: str = "train and serve models") -> None:
    """Refuse to serve beyond loopback without a token."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not token:
        raise ConfigError(
            f"refusing to listen on {host} without a token: anyone who can reach it could {what}. "
            "Pass --token (or JOURNEYMAN_TOKEN), or bind 127.0.0.1"
        )
