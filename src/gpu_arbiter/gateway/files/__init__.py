"""Model files that travel between hosts: a model entry's ``file`` (``spec.py``), each
host's store of them (``store.py``, with the pure choice of what to evict in
``evict.py``), the copy from a peer or a URL (``fetch.py``), the route that serves them
to peers (``route.py``), and the step that puts a replica's file in place before its
lease is asked for (``ensure.py``)."""
