"""What every part of the gateway uses, importing nothing else of it: the clock
(``clock.py``), races between waits written once, the wait an event cuts short among
them (``race.py``), cancel scopes (``scopes.py``), keep-alive HTTP/1.1 connections to a
model server or a peer gateway (``upstream.py``), and the gateway's metrics
(``metrics.py``)."""
