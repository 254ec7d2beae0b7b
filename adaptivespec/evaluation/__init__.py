"""Evaluation sets (GSM8K, MATH-500, HumanEval, Spec-Bench, MT-Bench) and their graders.

``load_dataset(name)`` returns :class:`Problem` records whose ``prompt`` is the user message to
send; ``grade(problem, completion)`` returns a :class:`GradeResult`. The data files ship with the
package under ``data/`` (see ``data/README.md`` for provenance and licenses).
"""

from __future__ import annotations

from adaptivespec.evaluation.datasets import DATASETS, DatasetError, Problem, load_dataset
from adaptivespec.evaluation.graders import GradeResult, grade

__all__ = ["DATASETS", "DatasetError", "GradeResult", "Problem", "grade", "load_dataset"]
