"""The controller's HTTP service: FastAPI app factory, routes, schemas, auth, events."""

from .app import create_app
from .auth import Authenticator, Principal, create_token, ensure_admin_token

__all__ = ["Authenticator", "Principal", "create_app", "create_token", "ensure_admin_token"]
