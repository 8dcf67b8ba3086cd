"""Model servers on demand: a gateway that starts, keeps warm and stops model servers
under leases (see ``gateway/app.py`` for the routes, ``replica.py`` for a server's life,
``model.py`` for routing among replicas, ``estimate.py`` for ``vram = "auto"``)."""

from .config import GatewayConfig, ModelConfig, load_config, parse_config
from .estimate import Estimate, estimate_vram

__all__ = [
    "Estimate",
    "GatewayConfig",
    "ModelConfig",
    "estimate_vram",
    "load_config",
    "parse_config",
]
