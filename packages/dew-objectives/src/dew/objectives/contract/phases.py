"""How the trainer calls an objective beyond ``loss``: the optional phases it declares
and the one form of ``init``.

An objective declares its prepare phase in :attr:`Phases.phases`, from
:data:`PHASES`: ``("prepare",)`` (one compiled part), or
``("prepare", "prepare_host", "prepare_finish")`` (compiled -> host Python ->
compiled). A family whose phases depend on its settings makes ``phases`` a property
(Distillation prepares only when it samples). The trainer reads the declaration
(:attr:`Phases.has_prepare`, :attr:`Phases.has_prepare_host`), never which methods a
class overrides; a declared phase the class does not define is a TypeError when the
class is made (or, for a property, before anything is compiled).

``init(key, spec=None)`` is the one form of ``init``; :meth:`Phases.initialize`, what
the trainer calls, still runs a seed-style ``init(self, key)``, with one
DeprecationWarning per class.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

PHASES = ("prepare", "prepare_host", "prepare_finish")
_SIGNATURES = {
    "prepare": "prepare(self, variables, batch, step)",
    "prepare_host": "prepare_host(self, rollout)",
    "prepare_finish": "prepare_finish(self, variables, batch, step)",
}
_warned: set[tuple[type, str]] = set()


def default(method):
    """Mark a contract method as the default an objective may override (or not)."""
    method.contract_default = True
    return method


def _defines(cls: type, name: str) -> bool:
    """``cls`` (or a class between it and the contract) defines method ``name``."""
    method = getattr(cls, name, None)
    return method is not None and not getattr(method, "contract_default", False)


def _warn_once(cls: type, what: str, message: str) -> None:
    if (cls, what) not in _warned:
        _warned.add((cls, what))
        warnings.warn(message, DeprecationWarning, stacklevel=4)


def check_phases(cls: type, phases: Any) -> tuple[str, ...]:
    """``phases`` checked against :data:`PHASES` and against the methods of ``cls``:
    a tuple of phase names, ``prepare_host`` only with ``prepare``, ``prepare_finish``
    only with ``prepare_host``, each defined by the class. Raises TypeError or
    ValueError naming the class, the phase and what to do."""
    what = cls.__name__
    if not isinstance(phases, tuple) or not all(isinstance(p, str) for p in phases):
        raise TypeError(f"{what}.phases must be a tuple of phase names {PHASES}, got {phases!r}")
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ValueError(f"{what}.phases names {unknown}: the phases are {PHASES}")
    for phase, needs in (("prepare_host", "prepare"), ("prepare_finish", "prepare_host")):
        if phase in phases and needs not in phases:
            raise ValueError(
                f"{what}.phases declares {phase!r} without {needs!r}: {phase} runs after "
                f"{needs}; declare {needs!r} too, or leave {phase!r} out"
            )
    missing = [p for p in phases if not _defines(cls, p)]
    if missing:
        raise TypeError(
            f"{what} declares the phase(s) {missing} but does not define "
            f"{', '.join(_SIGNATURES[p] for p in missing)}: define them, or leave them out "
            f"of {what}.phases"
        )
    return phases


class Phases:
    """The part of :class:`~dew.objectives.contract.objective.Objective` the trainer
    reads before compiling: the declared prepare phases (:attr:`phases`), the
    optional methods an objective has (``evaluate``, ``preview``), and ``init``'s one
    form (:meth:`initialize`)."""

    phases: ClassVar[tuple[str, ...]] = ()
    """The optional phases this objective has, from :data:`PHASES` (a property where
    they depend on the settings)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if isinstance(vars(cls).get("phases"), tuple):  # declared on the class: now
            check_phases(cls, cls.phases)

    def declared_phases(self) -> tuple[str, ...]:
        """:attr:`phases`, checked (:func:`check_phases`). A class of the seed's time
        that overrides ``prepare`` but declares nothing has its overrides read as
        its declaration, with one DeprecationWarning."""
        cls = type(self)
        declared = any("phases" in vars(c) for c in cls.__mro__ if c is not Phases)
        if not declared and _defines(cls, "prepare"):
            found = tuple(p for p in PHASES if _defines(cls, p))
            found = found if "prepare_host" in found else ("prepare",)
            _warn_once(
                cls,
                "phases",
                f"{cls.__name__} defines prepare but declares no phases: write "
                f"phases = {found!r} in the class (the trainer will stop reading which "
                f"methods a class overrides)",
            )
            return found
        return check_phases(cls, self.phases)

    @default
    def prepare(self, variables, batch: Mapping[str, Any], step):
        """Optional: turn a data batch into a training batch, compiled and without
        gradients, on the pre-update weights (rollouts and their rewards,
        reference log-probs, values and advantages; masks; noise). The trainer
        then runs ``prepared_updates.per_batch`` optimizer updates over its rows. Every
        array's leading dimension is the rows, divisible by ``prepared_updates.minibatches``.
        With :meth:`prepare_host`, this is the first of three parts: compiled
        ``prepare`` -> host ``prepare_host`` -> compiled ``prepare_finish``."""
        raise NotImplementedError

    @default
    def prepare_host(self, rollout: Mapping[str, Any]) -> dict[str, Any]:
        """Optional: host Python between :meth:`prepare` and :meth:`prepare_finish`
        (rewards over decoded text, a reward model served elsewhere).

        rollout: :meth:`prepare`'s output as numpy arrays, every row of the global
          batch (gathered from all processes). Returns new arrays with the same
          leading rows axis; the trainer places them on the mesh and passes
          ``{**prepare's output, **these}`` to :meth:`prepare_finish`, compiled.
        Raising (a ``ValueError`` naming the bad row) ends ``fit`` before any
        update of this batch is applied; checkpoints already written stay.
        Must be a pure function of ``rollout``, so a resumed run repeats it."""
        raise NotImplementedError

    @default
    def prepare_finish(self, variables, batch: Mapping[str, Any], step):
        """Optional, with :meth:`prepare_host`: the second compiled part of the
        prepare phase (advantages from the host's rewards), on the same
        pre-update weights, without gradients. Returns the training batch.
        Default: the batch as it is."""
        return dict(batch)

    @property
    def has_prepare(self) -> bool:
        """The trainer runs :meth:`prepare` before the updates of each batch."""
        return "prepare" in self.declared_phases()

    @property
    def has_prepare_host(self) -> bool:
        """The prepare phase runs in three parts (compiled, host, compiled)."""
        return "prepare_host" in self.declared_phases()

    @property
    def has_evaluate(self) -> bool:
        return _defines(type(self), "evaluate")

    @property
    def has_preview(self) -> bool:
        return _defines(type(self), "preview")

    def initialize(self, key, spec: Mapping[str, Any] | None = None):
        """What the trainer calls to initialise the variables for data of batch spec
        ``spec`` (None when the data declares none): ``init(key, spec=spec)``. A
        seed-style ``init(self, key)`` is called as ``init(key)``, with one
        DeprecationWarning for its class."""
        cls = type(self)
        parameters = inspect.signature(cls.init).parameters.values()
        if any(p.name == "spec" or p.kind is p.VAR_KEYWORD for p in parameters):
            return self.init(key, spec=spec)
        _warn_once(
            cls,
            "init",
            f"{cls.__name__}.init(self, key) is the seed's form; write "
            f"init(self, key, spec=None) (spec: the data's batch spec, None when it "
            f"declares none)",
        )
        return self.init(key)
