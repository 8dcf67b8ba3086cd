"""A model server's life under its lease (imports only ``base/`` and ``profile/``): a
model's replicas and the queue for them (``model.py``; ``ollama.py`` for the models of
one ``ollama serve``), one server's life (``replica.py``; the asleep tier,
``asleep.py``; the states and the moves between them, ``states.py``), what each engine
is told and asked (``engines.py``), a model's settings (``config.py``) and ``vram =
"auto"`` (``estimate.py``), the lease as the gateway reads it (``lease.py``), and what
the life runs on behind small interfaces (``interfaces.py``; real: ``process.py`` and
``watchdog.py``, ``links.py``)."""
