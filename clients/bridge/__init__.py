"""The phone gateway (``flowerbed bridge``): phones join a Flower federation.

Phones speak the small HTTP protocol of ``android_client/PROTOCOL.md``; the gateway
turns each authenticated phone into its own Flower node on the SuperLink's Fleet
API and relays train/evaluate messages to it. See docs/bridge.md.
"""

from flowerbed.clients.bridge.codec import (
    TensorCodecError,
    decode_tensors,
    encode_tensors,
)
from flowerbed.clients.bridge.gateway import Gateway, GatewaySettings
from flowerbed.clients.bridge.relay import NodeRelay, SuperLinkConnector
from flowerbed.clients.bridge.server import GatewayServer
from flowerbed.clients.bridge.tokens import TokenFileError, load_tokens

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
