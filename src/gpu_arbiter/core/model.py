"""The values of the decision core: GPUs, workers, requests, leases, policy.

All are frozen dataclasses; the scheduler replaces them, it never mutates them.
A lease's life::

    pending --grant--> loading --ready--> active --release--> released
       |                  |  load_timeout -> active            |
       |                  +--------- revoke -------------------+--> revoking --stopped--> released
       +--> timed_out | cancelled | rejected         TTL lapsed (any held state) --> expired
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from operator import attrgetter
from typing import Any, Literal, TypeVar, final

from .errors import InvalidInput
from .units import PRIORITY_NAMES, is_ascii_number, parse_mb, parse_priority

__all__ = [
    "Constraints",
    "Gpu",
    "GpuId",
    "GpuProbe",
    "Lease",
    "LeaseState",
    "Policy",
    "Request",
    "Worker",
    "WorkerStatus",
    "check_metadata",
    "check_text",
    "compute_capability",
    "evolve",
    "json_value_problem",
    "slot_init",
    "validate_worker_name",
]

_T = TypeVar("_T")
_WORKER_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_ARCH = re.compile(r"^(sm_\d{2,3}|gfx[0-9a-f]{3,4}|[a-z][a-z0-9_]{0,31})$", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
MAX_TEXT = 256
MAX_METADATA_KEYS = 32
MAX_METADATA_BYTES = 4096
MAX_METADATA_DEPTH = 8
MAX_GPUS_PER_REQUEST = 64
MAX_NEVER_PREEMPT = 16
MAX_WORKER_NAMES = 64  # constraints.workers, constraints.prefer_workers
_LEASE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$", re.ASCII)  # as the routes take them


def evolve(value: _T, **changes: Any) -> _T:
    """A copy of a frozen, slotted dataclass with ``changes``: ``dataclasses.replace`` without
    re-running validation, for the core's own state changes on its hot path.

    A class without ``__post_init__`` has no validation to skip: it is copied through its
    own ``__init__``, the fastest way to fill a frozen instance (a lease and a request are
    copied at every grant and release); one with it is filled slot by slot."""
    cls = type(value)
    layout = _LAYOUTS.get(cls) or _layout(cls)
    read, index, direct = layout
    values = list(read(value))
    for name, changed in changes.items():
        if name not in index:
            raise TypeError(f"{cls.__name__} has no field {name}")
        values[index[name]] = changed
    if direct:
        return cls(*values)
    new = object.__new__(cls)
    for name, current in zip(index, values, strict=True):
        object.__setattr__(new, name, current)
    return new


_Layout = tuple[Callable[[Any], tuple[Any, ...]], dict[str, int], bool]
_LAYOUTS: dict[type, _Layout] = {}


def _layout(cls: type) -> _Layout:
    """How :func:`evolve` reads and fills instances of ``cls``: its slots, in order, and
    whether its ``__init__`` takes exactly them, positionally, and validates nothing."""
    names: tuple[str, ...] = cls.__slots__  # type: ignore[attr-defined]
    init_names = tuple(f.name for f in fields(cls) if f.init)
    direct = init_names == names and not hasattr(cls, "__post_init__")
    read = attrgetter(*names) if len(names) > 1 else lambda v: tuple(getattr(v, n) for n in names)
    layout = _LAYOUTS[cls] = (read, {n: i for i, n in enumerate(names)}, direct)
    return layout


class _Factory:
    """The default of a field whose default comes from a factory, in a :func:`slot_init`."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


def slot_init(cls: type[_T]) -> type[_T]:
    """Gives a frozen, slotted dataclass an ``__init__`` of the same signature that fills
    its slots by plain assignment, and makes the class final.

    Frozen, an instance refuses assignment, so the ``__init__`` that ``dataclass`` writes
    fills every field through ``object.__setattr__``: a call through a slot wrapper (an
    argument tuple built and taken apart) per field, most of the cost of a request or a
    lease, and they are built or copied (:func:`evolve`) several times per grant. This one
    makes the new instance, for the length of the ``__init__``, an instance of a twin class
    with the very same slots and no ``__setattr__`` (``__class__`` assignment is allowed
    between two classes of one layout), assigns the fields, and makes it an instance of
    ``cls`` again: frozen before anyone else can see it. No subclass may share the layout,
    so there is none. Only for a class that validates nothing (no ``__post_init__``) and
    whose fields are all ``__init__`` arguments."""
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} validates in __post_init__: keep its own __init__")
    slots: tuple[str, ...] = cls.__slots__  # type: ignore[attr-defined]
    unfrozen = type(f"_Unfrozen{cls.__name__}", (), {"__slots__": slots})
    scope: dict[str, Any] = {
        "_FACTORY": _FACTORY,
        "_cls": cls,
        "_unfrozen": unfrozen,
        "_set_class": object.__setattr__,
    }
    params: list[str] = []
    factories: list[str] = []
    for f in fields(cls):  # type: ignore[arg-type]
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name} is not a plain __init__ argument")
        if f.default is not MISSING:
            scope[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            scope[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_FACTORY")
            factories.append(f"    if {f.name} is _FACTORY: {f.name} = _factory_{f.name}()")
        else:
            params.append(f.name)
    body = [
        *factories,
        "    _set_class(self, '__class__', _unfrozen)",
        *(f"    self.{name} = {name}" for name in slots),
        "    self.__class__ = _cls",
    ]
    exec(f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body), scope)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__annotations__ = cls.__init__.__annotations__
    cls.__init__ = init  # type: ignore[method-assign]

    def refuse_subclass(subclass: type, /, **_: Any) -> None:
        raise TypeError(f"{cls.__name__} is final (its __init__ relies on its own layout)")

    cls.__init_subclass__ = classmethod(refuse_subclass)  # type: ignore[assignment]
    return cls


def json_value_problem(value: Any, max_depth: int) -> tuple[str, str] | None:
    """Where ``value`` is not strict JSON, and why: ``(path, reason)``, or None when it is.

    Strict JSON: objects with text keys, lists, text, finite numbers, booleans, null,
    nested at most ``max_depth`` deep. The walk stops at the first problem, so it is
    bounded by the depth whatever the value (no recursion error on a deep one)."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, dict | list) and depth >= max_depth:
            return path, f"nested deeper than {max_depth} levels"
        if isinstance(item, dict):
            for key, inner in item.items():
                if not isinstance(key, str):
                    return path, f"has a key that is not text ({type(key).__name__})"
                if not _encodable(key):  # named by its parent: the key cannot be written
                    return path, "has a key holding a lone surrogate: not valid Unicode text"
                stack.append((f"{path}.{key}" if path else key, inner, depth + 1))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", inner, depth + 1) for i, inner in enumerate(item))
        elif isinstance(item, float) and not math.isfinite(item):
            name = "NaN" if math.isnan(item) else "Infinity" if item > 0 else "-Infinity"
            return path, f"{name} is not a JSON number (numbers must be finite)"
        elif isinstance(item, str) and not _encodable(item):
            return path, "holds a lone surrogate: not valid Unicode text"
        elif item is not None and not isinstance(item, str | int | float):
            return path, f"a {type(item).__name__} is not a JSON value"
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(field: str, text: Any, *, max_len: int = MAX_TEXT, min_len: int = 0) -> str:
    """Free text of ``min_len..max_len`` chars with no control characters (NUL, newline,
    escape...): what a holder, an idempotency key or a label may be."""
    if not isinstance(text, str) or not min_len <= len(text) <= max_len:
        raise InvalidInput(field, f"must be text of {min_len}..{max_len} chars")
    if _CONTROL.search(text) or not _encodable(text):
        raise InvalidInput(field, "must not contain control characters or lone surrogates")
    return text


def check_metadata(metadata: Mapping[str, Any] | None, field: str = "metadata") -> dict[str, Any]:
    """A small JSON object: at most 32 keys, 8 levels and 4 KiB encoded, strict JSON."""
    meta = dict(metadata or {})
    if len(meta) > MAX_METADATA_KEYS:
        raise InvalidInput(field, f"must have at most {MAX_METADATA_KEYS} keys")
    problem = json_value_problem(meta, MAX_METADATA_DEPTH)
    if problem is not None:
        where, reason = problem
        raise InvalidInput(f"{field}.{where}" if where else field, reason)
    try:
        size = len(json.dumps(meta, separators=(",", ":")).encode())
    except ValueError as error:  # an integer too long to write
        raise InvalidInput(field, f"cannot be written as JSON: {error}") from None
    if size > MAX_METADATA_BYTES:
        raise InvalidInput(field, f"must be at most {MAX_METADATA_BYTES} bytes as JSON")
    return meta


def validate_worker_name(name: str, field_name: str = "worker") -> str:
    """Case-folds and checks ``[a-z0-9][a-z0-9._-]{0,62}``."""
    if not isinstance(name, str):
        raise InvalidInput(field_name, "must be a string")
    folded = name.strip().lower()
    if not _WORKER_NAME.match(folded):
        raise InvalidInput(
            field_name,
            f"{name!r} is not a worker name: 1-63 of a-z 0-9 . _ - starting with a letter or digit",
        )
    return folded


def compute_capability(arch: str) -> tuple[int, int] | None:
    """'sm_86' -> (8, 6); 'sm_100' -> (10, 0); anything else (AMD 'gfx1100') -> None."""
    if not arch.startswith("sm_") or not is_ascii_number(arch[3:]) or len(arch) < 5:
        return None
    digits = arch[3:]
    return int(digits[:-1]), int(digits[-1])


def _parse_capability(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d{1,2})\.(\d)\s*", text, re.ASCII)
    if match is None:
        raise InvalidInput(
            "constraints.min_compute_capability", f"{text!r} is not MAJOR.MINOR such as 8.0"
        )
    return int(match.group(1)), int(match.group(2))


class _HashedOnce:
    """A slot for a frozen dataclass's hash, computed on first use: a value that is a key
    of the core's tables (a GPU id, a request's constraints) is hashed several times per
    request, at the price of one attribute read after the first. A subclass takes
    ``__hash__ = _HashedOnce.cached_hash`` (a dataclass replaces an inherited one).

    The slot is not a field, so every copy starts without it: :func:`evolve`, ``replace``,
    ``copy`` and pickling fill only the fields and the copy computes its own hash."""

    __slots__ = ("_hash",)
    _hash: int

    def cached_hash(self) -> int:
        try:
            return self._hash
        except AttributeError:
            fields_of_value = self.__slots__  # a dataclass's slots are its fields
            value = hash(tuple(getattr(self, name) for name in fields_of_value))
            object.__setattr__(self, "_hash", value)
            return value


@dataclass(frozen=True, slots=True, order=True)
class GpuId(_HashedOnce):
    """``worker:index``, parsed exactly on the single ``:`` (never by prefix)."""

    worker: str
    index: int

    __hash__ = _HashedOnce.cached_hash

    def __str__(self) -> str:
        return f"{self.worker}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> GpuId:
        parts = text.split(":") if isinstance(text, str) else []
        if len(parts) != 2 or not parts[1].isdecimal() or not parts[1].isascii():
            raise InvalidInput("gpu", f"{text!r} is not WORKER:INDEX such as box-1:0")
        return cls(validate_worker_name(parts[0]), int(parts[1]))


@dataclass(frozen=True, slots=True)
class Gpu:
    """One device of a worker. ``capacity_mb = total_mb - headroom_mb`` is what leases may use."""

    index: int
    total_mb: int
    arch: str = ""
    worker: str = "local"
    vendor: str = "nvidia"
    model: str = ""
    uuid: str = ""
    headroom_mb: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise InvalidInput("gpu.index", "must be an integer >= 0")
        if isinstance(self.total_mb, bool) or not isinstance(self.total_mb, int):
            raise InvalidInput("gpu.total_mb", "must be an integer number of MiB")
        if self.total_mb <= 0:
            raise InvalidInput("gpu.total_mb", "must be > 0")
        if not isinstance(self.headroom_mb, int) or not 0 <= self.headroom_mb < self.total_mb:
            raise InvalidInput("gpu.headroom_mb", "must be >= 0 and below total_mb")
        if self.arch and not _ARCH.match(self.arch):
            raise InvalidInput("gpu.arch", f"{self.arch!r} is not an architecture like sm_86")
        object.__setattr__(self, "worker", validate_worker_name(self.worker, "gpu.worker"))
        object.__setattr__(self, "vendor", self.vendor.strip().lower())

    @property
    def id(self) -> GpuId:
        return GpuId(self.worker, self.index)

    @property
    def capacity_mb(self) -> int:
        return self.total_mb - self.headroom_mb


class WorkerStatus(StrEnum):
    ONLINE = "online"
    DRAINING = "draining"
    DRAINED = "drained"
    OFFLINE = "offline"


@dataclass(frozen=True, slots=True)
class Worker:
    name: str
    status: WorkerStatus = WorkerStatus.ONLINE
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", validate_worker_name(self.name, "name"))


@dataclass(frozen=True, slots=True)
class GpuProbe:
    """One probe reading of a GPU: used MiB, and per lease where the agent knows it."""

    used_mb: int
    lease_used_mb: Mapping[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Constraints(_HashedOnce):
    """Where a request may run. Hashable: requests of one shape share work.

    ``workers``: any of these workers (empty: any worker; with ``worker`` a GPU must
    satisfy both). ``prefer_workers``: no filter but a rank: among the GPUs where the
    request fits now, those of these workers come first (a model whose file one of them
    read last); it never changes whether, nor which victims, only where it is placed."""

    vendor: str | None = None
    min_compute_capability: tuple[int, int] | None = None
    gpu_arch: tuple[str, ...] = ()
    gpu_model: str | None = None
    worker: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    gpu_ids: tuple[GpuId, ...] = ()
    never_preempt: tuple[str, ...] = ()  # lease ids this request never takes (I5 aside)
    workers: tuple[str, ...] = ()  # sorted, distinct
    prefer_workers: tuple[str, ...] = ()  # sorted, distinct

    __hash__ = _HashedOnce.cached_hash

    @classmethod
    def build(
        cls,
        *,
        vendor: str | None = None,
        min_compute_capability: str | float | None = None,
        gpu_arch: list[str] | tuple[str, ...] | str | None = None,
        gpu_model: str | None = None,
        worker: str | None = None,
        labels: Mapping[str, str] | None = None,
        gpu_ids: list[str] | tuple[str, ...] | None = None,
        never_preempt: list[str] | tuple[str, ...] | None = None,
        workers: list[str] | tuple[str, ...] | None = None,
        prefer_workers: list[str] | tuple[str, ...] | None = None,
    ) -> Constraints:
        """Validates human input; every error names its field."""
        cc = None
        if min_compute_capability is not None:
            if isinstance(min_compute_capability, bool):
                raise InvalidInput("constraints.min_compute_capability", "must be like 8.0")
            cc = _parse_capability(str(min_compute_capability))
        archs: tuple[str, ...] = ()
        if gpu_arch is not None:
            raw = [gpu_arch] if isinstance(gpu_arch, str) else list(gpu_arch)
            for arch in raw:
                if not isinstance(arch, str) or not _ARCH.match(arch):
                    raise InvalidInput("constraints.gpu_arch", f"{arch!r} is not like sm_86")
            archs = tuple(sorted(set(raw)))
        for name, text in (("vendor", vendor), ("gpu_model", gpu_model)):
            if text is not None and (not isinstance(text, str) or not 0 < len(text) <= MAX_TEXT):
                raise InvalidInput(f"constraints.{name}", f"must be text of 1..{MAX_TEXT} chars")
        pairs: tuple[tuple[str, str], ...] = ()
        if labels:
            if not isinstance(labels, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
            ):
                raise InvalidInput("constraints.labels", "must map text to text")
            pairs = tuple(sorted(labels.items()))
        folded = validate_worker_name(worker, "constraints.worker") if worker else None
        any_of = () if workers is None else _parse_worker_names(workers, "constraints.workers", 1)
        return cls(
            vendor=vendor.lower() if vendor else None,
            min_compute_capability=cc,
            gpu_arch=archs,
            gpu_model=gpu_model,
            worker=folded,
            labels=pairs,
            gpu_ids=() if gpu_ids is None else _parse_gpu_ids(gpu_ids, folded, any_of),
            never_preempt=_parse_lease_ids(never_preempt),
            workers=any_of,
            prefer_workers=()
            if prefer_workers is None
            else _parse_worker_names(prefer_workers, "constraints.prefer_workers", 0),
        )

    def describe(self) -> str:
        parts = []
        if self.vendor:
            parts.append(f"vendor={self.vendor}")
        if self.min_compute_capability:
            parts.append("min_cc={}.{}".format(*self.min_compute_capability))
        if self.gpu_arch:
            parts.append("arch=" + "|".join(self.gpu_arch))
        if self.gpu_model:
            parts.append(f"model={self.gpu_model}")
        if self.worker:
            parts.append(f"worker={self.worker}")
        if self.workers:
            parts.append("workers=" + "|".join(self.workers))
        parts.extend(f"{k}={v}" for k, v in self.labels)
        if self.gpu_ids:
            parts.append("gpu_ids=" + "|".join(map(str, self.gpu_ids)))
        if self.never_preempt:
            parts.append("never_preempt=" + "|".join(self.never_preempt))
        if self.prefer_workers:
            parts.append("prefer_workers=" + "|".join(self.prefer_workers))
        return ",".join(parts) or "any GPU"


_ANY_GPU = Constraints()  # no constraint: one shared value, valid as it is


def _parse_worker_names(texts: Any, field_name: str, least: int) -> tuple[str, ...]:
    """``least``..64 worker names, each checked and case-folded as ``constraints.worker``;
    sorted, each once."""
    if isinstance(texts, str) or not isinstance(texts, list | tuple):
        raise InvalidInput(field_name, "must be a list of worker names")
    if not least <= len(texts) <= MAX_WORKER_NAMES:
        raise InvalidInput(field_name, f"must name {least}..{MAX_WORKER_NAMES} workers")
    return tuple(sorted({validate_worker_name(text, field_name) for text in texts}))


def _parse_gpu_ids(
    texts: Any, worker: str | None, workers: tuple[str, ...] = ()
) -> tuple[GpuId, ...]:
    """Exact GPUs (``worker:index``, split on the single ``:``), all on one worker: a
    request that must land where its process already lives (a sleeping model server that
    wakes asks for its full lease again on its own GPUs)."""
    field_name = "constraints.gpu_ids"
    if isinstance(texts, str) or not isinstance(texts, list | tuple):
        raise InvalidInput(field_name, "must be a list of WORKER:INDEX such as box-1:0")
    if not 1 <= len(texts) <= MAX_GPUS_PER_REQUEST:
        raise InvalidInput(field_name, f"must name 1..{MAX_GPUS_PER_REQUEST} GPUs")
    try:
        ids = [GpuId.parse(text) for text in texts]
    except InvalidInput as error:
        raise InvalidInput(field_name, error.reason) from None
    if len(set(ids)) != len(ids):
        raise InvalidInput(field_name, "names a GPU twice")
    on = sorted({gpu_id.worker for gpu_id in ids})
    if len(on) > 1:
        raise InvalidInput(field_name, f"must all be on one worker (got {', '.join(on)})")
    if worker is not None and on[0] != worker:
        raise InvalidInput(field_name, f"are on worker {on[0]}, not constraints.worker")
    if workers and on[0] not in workers:
        raise InvalidInput(field_name, f"are on worker {on[0]}, not one of constraints.workers")
    return tuple(sorted(ids))


def _parse_lease_ids(texts: Any) -> tuple[str, ...]:
    """Leases a request must never preempt, nor reclaim while idle: a lease that grows by
    a second one (a sleeping model server that wakes asks for the difference on its own
    GPUs) names its first, which a request of a higher priority would otherwise revoke
    to make room for the very memory it wakes into."""
    field_name = "constraints.never_preempt"
    if texts is None:
        return ()
    if isinstance(texts, str) or not isinstance(texts, list | tuple):
        raise InvalidInput(field_name, "must be a list of lease ids")
    if len(texts) > MAX_NEVER_PREEMPT:
        raise InvalidInput(field_name, f"must name at most {MAX_NEVER_PREEMPT} leases")
    for text in texts:
        if not isinstance(text, str) or not _LEASE_ID.match(text):
            raise InvalidInput(field_name, f"{text!r} is not a lease id")
    return tuple(sorted(set(texts)))


@final  # see slot_init
@slot_init
@dataclass(frozen=True, slots=True)
class Request:
    """What a client asks for. Build with :meth:`build` to validate human input."""

    id: str
    vram_mb: int
    gpus: int = 1
    priority: int = PRIORITY_NAMES["normal"]
    preemptible: bool = True
    constraints: Constraints = _ANY_GPU
    holder: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    ttl_s: float | None = 30.0
    max_wait_s: float | None = None
    load_timeout_s: float = 300.0
    idempotency_key: str | None = None
    seq: int = 0
    submitted_at: float = 0.0

    @property
    def base_priority(self) -> int:
        return self.priority

    @property
    def shape(self) -> tuple[int, int, Constraints]:
        return (self.vram_mb, self.gpus, self.constraints)

    @classmethod
    def build(
        cls,
        id: str,
        *,
        vram_mb: int | str,
        gpus: int | None = None,
        priority: int | str = "normal",
        preemptible: bool | None = None,
        constraints: Constraints | None = None,
        holder: str = "",
        metadata: Mapping[str, Any] | None = None,
        ttl_s: float | None = 30.0,
        max_wait_s: float | None = None,
        load_timeout_s: float = 300.0,
        idempotency_key: str | None = None,
    ) -> Request:
        """Validates every field (errors name it). ``ttl_s=None``: no TTL, for a holder in
        this very process whose lease ends with its block. ``gpus``: by default the number
        of ``constraints.gpu_ids``, else 1; with them it must equal their number.

        What is left at its default (no metadata, no holder) is valid as it is and is not
        checked again, and the scalar fields are checked once per distinct set of values:
        an in-process ``acquire`` builds one request per lease, mostly alike."""
        args = (vram_mb, priority, preemptible, ttl_s, max_wait_s, load_timeout_s)
        try:
            scalars = _checked_scalars(*args)
        except TypeError:  # an unhashable value: checked without the cache, to name its field
            scalars = _checked_scalars.__wrapped__(*args)
        mb, prio, preemptible, ttl_s, max_wait_s, load_timeout_s = scalars
        constraints = constraints or _ANY_GPU
        gpus = _check_gpus(gpus, constraints.gpu_ids)
        if holder != "":
            check_text("holder", holder)
        meta = check_metadata(metadata) if metadata else {}
        if idempotency_key is not None:
            check_text("idempotency_key", idempotency_key, min_len=1)
        return cls(
            id=id,
            vram_mb=mb,
            gpus=gpus,
            priority=prio,
            preemptible=preemptible,
            constraints=constraints,
            holder=holder,
            metadata=meta,
            ttl_s=ttl_s,
            max_wait_s=max_wait_s,
            load_timeout_s=load_timeout_s,
            idempotency_key=idempotency_key,
        )


_Scalars = tuple[int, int, bool, float | None, float | None, float]


@functools.lru_cache(maxsize=256, typed=True)  # typed: True and 1, 30 and 30.0 kept apart
def _checked_scalars(
    vram_mb: Any,
    priority: Any,
    preemptible: Any,
    ttl_s: Any,
    max_wait_s: Any,
    load_timeout_s: Any,
) -> _Scalars:
    """A request's size, priority, preemptibility and times, checked (errors name the field)
    and in the form a :class:`Request` holds them. Pure, hence cached by ``Request.build``."""
    mb = parse_mb(vram_mb, "vram_mb")
    if mb <= 0:
        raise InvalidInput("vram_mb", "must be > 0")
    prio = parse_priority(priority)
    if preemptible is None:
        preemptible = prio < PRIORITY_NAMES["interactive"]
    elif not isinstance(preemptible, bool):
        raise InvalidInput("preemptible", "must be true or false")
    _check_seconds("ttl_s", ttl_s, allow_none=True)
    _check_seconds("max_wait_s", max_wait_s, allow_none=True, allow_zero=True)
    _check_seconds("load_timeout_s", load_timeout_s, allow_none=False)
    return (
        mb,
        prio,
        preemptible,
        None if ttl_s is None else float(ttl_s),
        None if max_wait_s is None else float(max_wait_s),
        float(load_timeout_s),
    )


def _check_gpus(gpus: Any, gpu_ids: tuple[GpuId, ...]) -> int:
    """The request's GPU count: ``gpus`` as given, or the number of exact GPUs asked for."""
    if gpus is None:
        return len(gpu_ids) or 1
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS_PER_REQUEST:
        raise InvalidInput("gpus", f"must be an integer 1..{MAX_GPUS_PER_REQUEST}")
    if gpu_ids and gpus != len(gpu_ids):
        raise InvalidInput(
            "gpus", f"must equal the number of constraints.gpu_ids ({len(gpu_ids)}), or be left out"
        )
    return gpus


def _check_seconds(name: str, value: Any, *, allow_none: bool, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(name, "must be a number of seconds")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise InvalidInput(name, "must be a finite number of seconds > 0")
    if value > 366 * 86400:
        raise InvalidInput(name, "must be at most a year")


class LeaseState(StrEnum):
    PENDING = "pending"
    LOADING = "loading"
    ACTIVE = "active"
    REVOKING = "revoking"
    RELEASED = "released"
    EXPIRED = "expired"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    REJECTED = "rejected"

    @property
    def holds_memory(self) -> bool:
        return self in _HELD

    @property
    def is_final(self) -> bool:
        return self in _FINAL


_HELD = frozenset({LeaseState.LOADING, LeaseState.ACTIVE, LeaseState.REVOKING})
_FINAL = frozenset(
    {
        LeaseState.RELEASED,
        LeaseState.EXPIRED,
        LeaseState.TIMED_OUT,
        LeaseState.CANCELLED,
        LeaseState.REJECTED,
    }
)


@final  # see slot_init
@slot_init
@dataclass(frozen=True, slots=True)
class Lease:
    """A grant of ``vram_mb`` on each of ``gpus``, fenced by a strictly increasing ``token``.

    ``revoked_at``: when its revocation started (None while not revoked). ``supervised``: an
    agent watches the lease's process and will confirm when it exited; a lapsed TTL then
    revokes the lease instead of freeing its memory (I4). ``shrunk_to_mb``: what it holds
    per GPU since its holder shrank it (None: all it was granted, the request's
    ``vram_mb``); a lease shrinks, it never grows back. ``claimed``: its holder has taken
    the grant up (False from a grant made while nobody waited for the answer until the
    holder renews, reads, readies or runs it: see :class:`~.presence.Presence`)."""

    request: Request
    gpus: tuple[GpuId, ...]
    token: int
    state: LeaseState
    granted_at: float
    expires_at: float
    load_deadline: float
    idle: bool = False
    last_used_at: float = 0.0
    loading: bool = True
    revoke_reason: str | None = None
    preempted_for: str | None = None
    ended_at: float | None = None
    revoked_at: float | None = None
    supervised: bool = False
    shrunk_to_mb: int | None = None
    claimed: bool = True

    @property
    def id(self) -> str:
        return self.request.id

    def grace_ends_at(self, grace_s: float) -> float | None:
        """When a revoked lease's grace ends: after it, the lease cannot be renewed."""
        return None if self.revoked_at is None else self.revoked_at + grace_s

    @property
    def vram_mb(self) -> int:
        """What the lease holds per GPU now (committed, I1)."""
        return self.request.vram_mb if self.shrunk_to_mb is None else self.shrunk_to_mb

    @property
    def granted_mb(self) -> int:
        """What it was granted per GPU: the request's ``vram_mb``."""
        return self.request.vram_mb

    @property
    def base_priority(self) -> int:
        return self.request.priority

    @property
    def worker(self) -> str:
        return self.gpus[0].worker


@dataclass(frozen=True, slots=True)
class Policy:
    """Every setting of the scheduling policy, with its default.

    max_concurrent_loads  leases per GPU in state ``loading`` at once (I3); 1 avoids
                          the concurrent-load driver crash.
    placement             ``binpack`` (least memory left after placing: keeps large
                          holes for large requests) or ``spread`` (most left).
    aging_interval_s      a pending request's effective priority rises by
    aging_step            ``aging_step`` per ``aging_interval_s`` waited ...
    aging_cap             ... but never above ``aging_cap`` (below ``interactive``).
                          Aging orders the queue; it never gives preemption rights.
    preempt_exempt_s      a lease younger than this is not preempted unless idle.
    idle_reclaim_s        an idle (keep-warm) lease idle this long is reclaimable by a
                          request of any priority, least recently used first; before
                          that only by equal or higher priority. ``inf``: never.
    starvation_s          a request that has waited this long may reclaim any idle
                          lease, whatever its priority. ``inf``: never. Neither
                          setting gives rights over busy work (I5).
    preempt_patience_s    busy work is preempted only for a request that has waited
                          this long (0: at once), so that a short request does not
                          kill a long job when a warm copy or a release would serve
                          it a moment later. Idle leases are reclaimed at once.
    grace_s               how long a revoked holder has to stop before it is killed;
                          a revoked lease can be renewed only within it, and never
                          past ``revoked_at + grace_s + ttl_s``: a holder that ignores
                          its revocation keeps its memory at most grace + TTL (I4).
    claim_s               where askers must be present (the service), a grant its holder
                          has not taken up within ``min(claim_s, ttl_s / 3)`` is given
                          back (``unclaimed``): always well within its TTL (I8).
    """

    max_concurrent_loads: int = 1
    placement: Literal["binpack", "spread"] = "binpack"
    aging_interval_s: float = 60.0
    aging_step: int = 10
    aging_cap: int = 799
    preempt_exempt_s: float = 0.0
    grace_s: float = 10.0
    # Defaults chosen on the real-trace benchmark (bench/README.md, bench/sim_azure.py).
    idle_reclaim_s: float = 60.0
    starvation_s: float = 120.0
    preempt_patience_s: float = 0.0
    claim_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_concurrent_loads, int) or self.max_concurrent_loads < 1:
            raise InvalidInput("max_concurrent_loads", "must be an integer >= 1")
        if self.placement not in ("binpack", "spread"):
            raise InvalidInput("placement", "must be 'binpack' or 'spread'")
        if not self.aging_interval_s > 0:
            raise InvalidInput("aging_interval_s", "must be > 0")
        if not isinstance(self.aging_step, int) or self.aging_step < 0:
            raise InvalidInput("aging_step", "must be an integer >= 0")
        if not 0 <= self.aging_cap < PRIORITY_NAMES["interactive"]:
            raise InvalidInput("aging_cap", "must be in 0..799 (below interactive)")
        if self.preempt_exempt_s < 0:
            raise InvalidInput("preempt_exempt_s", "must be >= 0")
        if self.grace_s < 0:
            raise InvalidInput("grace_s", "must be >= 0")
        claim_s = self.claim_s
        if isinstance(claim_s, bool) or not isinstance(claim_s, int | float) or not claim_s > 0:
            raise InvalidInput("claim_s", "must be a number of seconds > 0")
        if not math.isfinite(claim_s):
            raise InvalidInput("claim_s", "must be a number of seconds > 0")
        for name in ("idle_reclaim_s", "starvation_s", "preempt_patience_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise InvalidInput(name, "must be a number of seconds >= 0 (inf: never)")

    def claim_bound_s(self, ttl_s: float | None) -> float:
        """How long a grant may wait for its holder to take it up: ``claim_s``, and
        less than a third of its TTL."""
        return self.claim_s if ttl_s is None else min(self.claim_s, ttl_s / 3)

    def effective_priority(self, request: Request, now: float) -> int:
        """Base priority plus aging, capped at ``aging_cap`` (never lowered by the cap)."""
        base = request.priority
        if base >= self.aging_cap or self.aging_step == 0:
            return base
        steps = int(max(0.0, now - request.submitted_at) // self.aging_interval_s)
        return min(self.aging_cap, base + steps * self.aging_step)
