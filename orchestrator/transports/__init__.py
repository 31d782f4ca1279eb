"""How the control plane reaches devices: one Transport per way in (adb for phones, http for
network agents, local for the host's own GPU), all with the same interface and errors
(base.py). Only agent/protocol documents and signed bundles cross this boundary."""

from orchestrator.transports.base import (
    BundleRefused,
    DeviceBusy,
    DeviceOffline,
    DeviceTimeout,
    DeviceUnauthorized,
    InfraFailure,
    NoScreen,
    ProtocolMismatch,
    SendReport,
    Transport,
    TransportError,
)

__all__ = ["BundleRefused", "DeviceBusy", "DeviceOffline", "DeviceTimeout", "DeviceUnauthorized", "InfraFailure",
           "NoScreen", "ProtocolMismatch", "SendReport", "Transport", "TransportError"]
