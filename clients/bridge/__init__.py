"""The phone gateway (``flowerbed bridge``): phones join a Flower federation.

Phones speak the small HTTP protocol of ``android_client/PROTOCOL.md``; the gateway
turns each authenticated phone into its own Flower node on the SuperLink's Fleet
API and relays train/evaluate messages to it. See docs/bridge.md.

Names are imported on first use, so importing a submodule (``flowerbed bridge
--help`` imports :mod:`flowerbed.clients.bridge.cli`) does not pull in Flower.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowerbed.lazy import lazy_names

if TYPE_CHECKING:
    from flowerbed.clients.bridge.codec import (
        TensorCodecError,
        decode_tensors,
        encode_tensors,
    )
    from flowerbed.clients.bridge.gateway import Gateway
    from flowerbed.clients.bridge.relay import NodeRelay, SuperLinkConnector
    from flowerbed.clients.bridge.server import GatewayServer
    from flowerbed.clients.bridge.settings import GatewaySettings
    from flowerbed.clients.bridge.tokens import TokenFileError, load_tokens

_EXPORTS = {
    "Gateway": "flowerbed.clients.bridge.gateway",
    "GatewayServer": "flowerbed.clients.bridge.server",
    "GatewaySettings": "flowerbed.clients.bridge.settings",
    "NodeRelay": "flowerbed.clients.bridge.relay",
    "SuperLinkConnector": "flowerbed.clients.bridge.relay",
    "TensorCodecError": "flowerbed.clients.bridge.codec",
    "TokenFileError": "flowerbed.clients.bridge.tokens",
    "decode_tensors": "flowerbed.clients.bridge.codec",
    "encode_tensors": "flowerbed.clients.bridge.codec",
    "load_tokens": "flowerbed.clients.bridge.tokens",
}

__all__ = [
    "Gateway",
    "GatewayServer",
    "GatewaySettings",
    "NodeRelay",
    "SuperLinkConnector",
    "TensorCodecError",
    "TokenFileError",
    "decode_tensors",
    "encode_tensors",
    "load_tokens",
]


__getattr__ = lazy_names(__name__, _EXPORTS)
