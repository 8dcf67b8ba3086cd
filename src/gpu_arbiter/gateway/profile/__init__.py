"""Routing as a profile (imports nothing else of the gateway): a request's candidates go
through filters, then weighted scorers, then a picker (``pick.py``), each rule a small
pure function over typed figures (``figures.py``); the rules and the profiles built of
them (``rules.py``); a request's prefix and where prefixes went, for prefix affinity
(``affinity.py``). The same machinery picks a host at the front door
(``cluster/routing.py``) and a replica inside it (``servers/model.py``)."""

from .affinity import Affinity, Memory
from .figures import Ask, Candidate
from .pick import Drop, Filter, Pick, Profile, Scorer, Verdict, rendezvous
from .rules import COMING, REPLICA, WARM, WEIGHTS, profiles

__all__ = [
    "COMING",
    "REPLICA",
    "WARM",
    "WEIGHTS",
    "Affinity",
    "Ask",
    "Candidate",
    "Drop",
    "Filter",
    "Memory",
    "Pick",
    "Profile",
    "Scorer",
    "Verdict",
    "profiles",
    "rendezvous",
]
