"""The request path (imports ``base/``, ``servers/`` and ``cluster/``): the ASGI routes,
their shared checks and the dispatch table (``app.py``); a request as one value, built at
the entry (``request.py``); the cluster's front door (``front_door.py``); a wait for a
replica or a load, as its caller sees it (``waits.py``); the relay to a replica here or
to a peer gateway (``relay.py``); the gateway's own answers (``answers.py``); who may use
the port (``access.py``); and what is held of request bodies and how the model is found
in them (``bodies.py``)."""
