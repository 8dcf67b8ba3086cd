"""How the core's values are built and copied fast: the one place of metaprogramming.

Why: the core's values are frozen, slotted dataclasses, and the scheduler replaces them
instead of mutating them. A lease and a request are built or copied at every grant and
release, several times per grant; a GPU id and a request's constraints are keys of the
core's tables, hashed several times per request. On that path, timed by the benchmarks
(``bench/bench_admission.py``, ``bench/bench_engine.py``), the plain dataclass machinery
is dear: ``dataclasses.replace`` runs the validation again, a frozen ``__init__`` sets
each field through ``object.__setattr__``, and a hash is computed at every lookup. The
tools below built and copied a request or a lease at half the cost, and took 11 % of
the instructions off an uncontended acquire and release. Three tools:

- :func:`evolve`: a copy with changes, without re-running ``__post_init__`` (the core's
  own state changes are valid by construction).
- :func:`slot_init`: a generated ``__init__`` that fills the slots by plain assignment,
  on a twin class of the same layout, instead of one ``object.__setattr__`` per field.
- :class:`HashedOnce`: a slot that remembers a value's hash after its first use.

How each works is told in its docstring. Nothing here knows the core's values: this
module imports only the standard library, and the values (:mod:`.model`) import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, fields
from operator import attrgetter
from typing import Any, TypeVar

__all__ = ["HashedOnce", "evolve", "slot_init"]

_T = TypeVar("_T")


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


class HashedOnce:
    """A slot for a frozen dataclass's hash, computed on first use: a value that is a key
    of the core's tables (a GPU id, a request's constraints) is hashed several times per
    request, at the price of one attribute read after the first. A subclass takes
    ``__hash__ = HashedOnce.cached_hash`` (a dataclass replaces an inherited one).

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
