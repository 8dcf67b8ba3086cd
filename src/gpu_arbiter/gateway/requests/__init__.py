"""The request path (imports ``base/``, ``servers/`` and ``cluster/``): the ASGI routes,
from a request's arrival to its relay to a replica here or to a peer gateway
(``app.py``), who may use the port (``access.py``), and what is held of request bodies
and how the model is found in them (``bodies.py``)."""
