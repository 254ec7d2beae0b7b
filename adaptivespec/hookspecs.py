"""Hook specifications of adaptivespec (pluggy project name ``adaptivespec``).

Three kinds of hook, grouped by lifecycle phase:

* **registration** hooks run once when the plugin manager starts; they receive a typed
  :class:`~adaptivespec.plugins.Registry` and register classes into it;
* **observer** hooks receive records and return ``None``; the decode loop calls them only when
  at least one plugin implements them, so they cost nothing otherwise.

Strategies are resolved once from the configuration and then called directly: no hook is called
on the per-step hot path except the observers a user installed on purpose.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("adaptivespec")


# -- registration (start-up) ----------------------------------------------------------------
@hookspec
def adaptivespec_register_policies(registry) -> None:
    """Register tree policies.

    :param registry: a :class:`~adaptivespec.plugins.Registry` of kind ``policy``; call
        ``registry.register(cls)`` with a :class:`~adaptivespec.strategies.TreePolicy` subclass
        whose ``name`` is unique. A duplicate name is refused with both providers named.

    Example::

        @adaptivespec.hookimpl
        def adaptivespec_register_policies(registry):
            registry.register(MyPolicy)
    """


@hookspec
def adaptivespec_register_verifiers(registry) -> None:
    """Register verifiers.

    :param registry: a :class:`~adaptivespec.plugins.Registry` of kind ``verifier``; call
        ``registry.register(cls)`` with a :class:`~adaptivespec.strategies.Verifier` subclass.
        Set ``lossless = False`` on any verifier that can accept a token other than the target's
        greedy choice: lossy acceptance is always opt-in and reported as such.
    """


@hookspec
def adaptivespec_register_drafters(registry) -> None:
    """Register drafter kinds.

    :param registry: a :class:`~adaptivespec.plugins.Registry` of kind ``drafter``; the class
        registered must provide ``from_pretrained(path, target, dtype, device)``. The built-in
        kind is ``eagle3``.
    """


@hookspec
def adaptivespec_register_runtimes(registry) -> None:
    """Register runtimes (where the target and drafter run).

    :param registry: a :class:`~adaptivespec.plugins.Registry` of kind ``runtime``; the class
        registered is built as ``cls(target, drafter, config)``. The built-in runtime is ``torch``.
    """


@hookspec
def adaptivespec_register_sources(registry) -> None:
    """Register candidate sources (drafting without a model, e.g. retrieval from the context).

    :param registry: a :class:`~adaptivespec.plugins.Registry` of kind ``source``; call
        ``registry.register(cls)`` with a :class:`~adaptivespec.strategies.CandidateSource`
        subclass. A config lists the sources it uses under ``sources:``; their proposals are fused
        with the head's tree in one verify budget. The built-in source is ``retrieval``.
    """


# -- observers (decode loop) ----------------------------------------------------------------
@hookspec
def adaptivespec_step(record) -> None:
    """Receive the record of one decode step.

    :param record: a :class:`~adaptivespec.types.StepRecord` (shape used, accepted length,
        promoted tokens, draft / verify / other milliseconds, the policy's signals and state).

    Called after every step, only when some plugin implements it. Return value ignored.
    """


@hookspec
def adaptivespec_generation_done(result) -> None:
    """Receive a finished generation.

    :param result: a :class:`~adaptivespec.decode.GenerationResult` (token ids, text, stats).
    """
