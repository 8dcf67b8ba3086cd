"""Model servers on demand: a gateway that starts, keeps warm and stops model servers
under leases, and relays requests to them as one of the cluster's front doors.

Five packages, each importing only those above it in this list (``tests/test_layering.py``
checks it):

- ``base/``: what every part uses: the clock (``clock.py``), races between waits whose
  tasks are all over when they return (``race.py``), cancel scopes
  (``scopes.py``), the keep-alive HTTP/1.1 connections to a server or a peer
  (``upstream.py``), the metrics (``metrics.py``);
- ``profile/``: routing as a profile, pure: filters, weighted scorers and a picker over
  typed figures of a host or a replica (``pick.py``, ``figures.py``), and the rules
  (``rules.py``), the same for a host at the front door and a replica inside it;
- ``servers/``: a model server's life under its lease: a model's replicas and the queue
  for them (``model.py``), one server's life (``replica.py``, ``asleep.py``,
  ``states.py``), the engines (``engines.py``, ``ollama.py``), ``vram = "auto"``
  (``estimate.py``), and the process, agent and lease behind small interfaces
  (``interfaces.py``; real: ``process.py``, ``watchdog.py``, ``links.py``, ``lease.py``);
- ``cluster/``: the other gateways as the controller shows them and the cluster's cold
  loads (``cluster.py``), where a request goes (``routing.py``, pure: two profiles, then
  the cold cases), and what this gateway tells the controller (``report.py``);
- ``requests/``: the request path: a request as one value (``request.py``), the shared
  checks and the dispatch table (``app.py``), the front door (``front_door.py``), a
  caller's wait (``waits.py``), the relay to a replica or a peer (``relay.py``), the
  gateway's own answers (``answers.py``), who may use the port (``access.py``) and the
  request bodies (``bodies.py``).

Beside them, the gateway as a whole: ``config.py`` reads ``models.toml`` and
``serve.py`` builds the parts and runs them; ``catalogue.py`` reads the cluster's
catalogue (the models declared once, at the controller, with the same model tables) and
cuts one worker's share of it, and ``follower.py`` follows the controller's revisions
of it.
"""

from .config import GatewayConfig, load_config, parse_config
from .servers.config import ModelConfig
from .servers.estimate import Estimate, estimate_vram

__all__ = [
    "Estimate",
    "GatewayConfig",
    "ModelConfig",
    "estimate_vram",
    "load_config",
    "parse_config",
]
