"""The gateway's model files set up at its start (``serve.py``): each ``{file}`` of a
command replaced by the file's path in ``models_dir``, the store opened there, and the
files already there verified (hashed once; remembered after), so that the first report
says which the peers may copy."""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ...core import InvalidInput
from ..base.clock import LoopClock
from ..servers.config import ModelConfig
from ..servers.estimate import estimate_vram
from .fetch import HttpFetcher, Sign
from .spec import placed_command
from .store import FileStore

__all__ = ["estimated", "open_store", "placed"]
MIB = 1 << 20
log = logging.getLogger("gpu_arbiter.gateway")


def placed(models: Mapping[str, ModelConfig], models_dir: Path) -> dict[str, ModelConfig]:
    """``models`` with each ``{file}`` its path in ``models_dir`` (the estimate of
    ``vram = "auto"`` reads it there: ``model_file``)."""
    found = {}
    for name, model in models.items():
        if model.file is not None:
            path = models_dir / model.file.name
            model = replace(
                model, command=placed_command(model.command, path), model_file=str(path.resolve())
            )
        found[name] = model
    return found


async def open_store(
    models: Mapping[str, ModelConfig],
    models_dir: Path,
    budget: int | None,
    sign: Sign,
    tls: ssl.SSLContext | None,
) -> tuple[FileStore, HttpFetcher]:
    """The store (its fetcher to close at the stop), each declared file already in
    ``models_dir`` verified."""
    fetcher = HttpFetcher(sign, tls)
    store = FileStore(models_dir, fetcher, LoopClock(), budget=budget, wall=time.time)
    for model in models.values():
        if model.file is not None:
            await store.verified(model.file)
    store.sweep()
    return store, fetcher


def estimated(
    models: Mapping[str, ModelConfig], store: FileStore
) -> tuple[dict[str, int], set[str]]:
    """The ``vram = "auto"`` size of each model with a file: estimated from the file where
    it is here already (their names, the second item); else, until it is (``ensure.py``
    estimates it then), the file's size: the least its weights take, so that a lease
    asked for meanwhile (a cluster's load) is never of nothing."""
    found, made = {}, set()
    for name, model in models.items():
        if model.vram is None and model.file is not None and not store.holds(model.file):
            found[name] = -(-model.file.size // MIB)
        elif model.vram is None and model.file is not None:
            try:
                found[name] = estimate_vram(
                    model.command, model_file=model.model_file, ctx=model.ctx, gpus=model.gpus
                ).total_mb
                made.add(name)
            except InvalidInput as error:
                found[name] = -(-model.file.size // MIB)
                log.warning("model %s: no estimate from its file yet: %s", name, error.reason)
    return found, made
