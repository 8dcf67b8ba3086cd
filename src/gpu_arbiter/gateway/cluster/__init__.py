"""The gateway as one of the cluster's front doors (imports ``base/`` and ``servers/``):
the other gateways as the controller shows them and the cluster's cold loads
(``cluster.py``), where a request goes (``routing.py``: a pure function), and what this
gateway tells the controller and takes from it (``report.py``)."""
