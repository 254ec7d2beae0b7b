"""The plugin API: everything a package that adds policies, verifiers, candidate sources, runtimes
or drafters may import from adaptivespec, in one module.

Stable: every name in ``__all__`` keeps its meaning and signature across minor versions (a change
is announced one minor version ahead). Everything else in adaptivespec is internal, whatever its
module is called, and may move without notice. The built-in strategies (``policies/``,
``verifiers/``, ``sources/``) are registered the way an outside plugin is, and import from here.

* **registration**: :data:`hookimpl`, for the hooks of :mod:`adaptivespec.hookspecs`;
* **strategies**: the base classes :class:`TreePolicy`, :class:`Verifier`, :class:`CandidateSource`
  (and :class:`NoParams`); a policy's fusion rules, :class:`FusionRules` and :class:`FusionRanking`;
* **values**: :class:`TreeShape`, :class:`DraftTree`, :class:`VerifyResult`, :class:`StepSignals`,
  :class:`StepRecord`, :class:`CandidateTrie`;
* **trees**: :func:`make_tree`, :func:`accepted_path`, :func:`path_to`, :func:`greedy_matches`,
  :func:`emit` (what a verifier builds its result with);
* **sampling**: :func:`greedy_ids`, :func:`sibling_accept`, :func:`residual_draw` (the lossless tree
  test at temperature > 0);
* **parameters**: the validators of a strategy's ``Params`` attrs class (:func:`positive_int`,
  :func:`optional_positive_int`, :func:`int_at_least`, :func:`number_in`, :func:`one_of`) and the
  converter :func:`as_tuple`;
* **what the step hands over**: the protocols :class:`Sampling` (``Verifier.sampler``),
  :class:`GrammarState` (``CandidateSource.constraint``), and what runtime and drafter plugins
  implement, :class:`Runtime` and :class:`Drafter`;
* **errors**: :class:`AdaptiveSpecError` (one line to the user, exit code 2), :class:`ConfigError`;
* **the machine**: :func:`cpu_kind` (``amx``, ``avx512``, ``avx2`` or None: for settings measured per CPU kind).

A plugin module then reads::

    from adaptivespec.api import TreePolicy, TreeShape, hookimpl, positive_int

    @hookimpl
    def adaptivespec_register_policies(registry):
        registry.register(MyPolicy)
"""

from __future__ import annotations

from adaptivespec import hookimpl
from adaptivespec.errors import AdaptiveSpecError, ConfigError
from adaptivespec.fusion_rules import FusionRanking, FusionRules
from adaptivespec.hardware import cpu_kind
from adaptivespec.params import as_tuple, int_at_least, number_in, one_of, optional_positive_int, positive_int
from adaptivespec.protocols import Drafter, GrammarState, Runtime, Sampling
from adaptivespec.tree_sampling import greedy_ids, residual_draw, sibling_accept
from adaptivespec.strategies import CandidateSource, NoParams, TreePolicy, Verifier
from adaptivespec.tree import accepted_path, emit, greedy_matches, make_tree, path_to
from adaptivespec.types import CandidateTrie, DraftTree, StepRecord, StepSignals, TreeShape, VerifyResult

__all__ = [
    # registration
    "hookimpl",
    # strategies
    "TreePolicy", "Verifier", "CandidateSource", "NoParams", "FusionRules", "FusionRanking",
    # values
    "TreeShape", "DraftTree", "VerifyResult", "StepSignals", "StepRecord", "CandidateTrie",
    # trees
    "make_tree", "accepted_path", "path_to", "greedy_matches", "emit",
    # sampling
    "greedy_ids", "sibling_accept", "residual_draw",
    # parameters
    "positive_int", "optional_positive_int", "int_at_least", "number_in", "one_of", "as_tuple",
    # what the step hands over
    "Sampling", "GrammarState", "Runtime", "Drafter",
    # errors
    "AdaptiveSpecError", "ConfigError",
    # the machine
    "cpu_kind",
]
