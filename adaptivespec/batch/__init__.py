"""Continuous batching of speculative trees: many requests share every step.

The invariant (as vLLM V1's scheduler states its own): there is no prefill phase and no decode
phase. Every step brings each running request closer to its end: a request still reading its
prompt gets a chunk of it, a decoding one gets its verify tree (or its one plain row), and all of
those rows run through the target in **one** packed forward. Requests join and leave between steps.

Who does what, in the order of a step (:meth:`BatchEngine.step <adaptivespec.batch.engine.BatchEngine.step>`)::

    Request (request.py)        one state object per request: status, tokens, prefill progress,
         │                      its lane (caches + strategies); nothing else holds per-request truth
         ▼
    Scheduler.plan (scheduler.py)  decides only: who joins a free lane, who leaves, which prompt
         │                         chunks run (their rows sized by the cost table), who decodes
         ▼  StepPlan (frozen)
    BatchEngine.step (engine.py)   runs the plan:
        1. propose  each decoder's sources and policy, then every head tree drafted together
                    (one draft-head pass per depth level for all requests)
        2. budget   RowBudget (budget.py): every candidate node of every request in one ranking,
                    the prefix that maximises expected tokens per millisecond is verified
        3. verify   one packed target forward (fastpath/batched.py): prompt chunks, trees, plain rows
        4. commit   per request: its verifier, its caches, its tokens, stop checks; the draft head
                    extended for every request in one pass (fresh even when it verified nothing)
"""

from adaptivespec.batch.budget import CostTable, RowBudget
from adaptivespec.batch.engine import BatchEngine
from adaptivespec.batch.request import Request, Status
from adaptivespec.batch.scheduler import Scheduler, StepPlan

__all__ = ["BatchEngine", "CostTable", "Request", "RowBudget", "Scheduler", "Status", "StepPlan"]
