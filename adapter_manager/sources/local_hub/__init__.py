"""A local Hugging Face Hub mirror on loopback: the repo layout (revisions, commit shas) and the HTTP server."""

from .layout import HubLayout, HubLookupError, HubRevision
from .server import HubFault, HubRequest, LocalHub, serve

__all__ = ["HubFault", "HubLayout", "HubLookupError", "HubRequest", "HubRevision", "LocalHub", "serve"]
