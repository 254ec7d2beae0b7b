"""Continuous batching of speculative trees: many requests share every step.

The invariant (as vLLM V1's scheduler states its own): there is no prefill phase and no decode
phase. Every step brings each running request closer to its end: a request still reading its
prompt gets a chunk of it, a decoding one gets its verify tree (or its one plain row), and all of
those rows run through the target in **one** packed forward. Requests join and leave between steps.

Who does what, in the order of a step (:meth:`BatchEngine.step <adaptivespec.batch.engine.BatchEngine.step>`)::

    Request (request.py)        one state object per request: status, tokens, prefill progress,
         │                      its lane (an Engine of the config: caches + strategies)
         ▼
    Scheduler.schedule (scheduler.py)  owns waiting, running and the free lanes: takes the cancelled
         │                         out, admits waiting requests (the prefix cache's match), sizes the
         │                         prompt chunks (by the cost table): one plan per step
         ▼  StepPlan (frozen)
    BatchEngine.step (engine.py)   runs the plan:
        1. propose  each decoder's sources and policy; every head tree drafted together
                    (head.py: one draft-head pass per depth level for all requests)
        2. budget   RowBudget (budget.py): every candidate node of every request in one ranking,
                    the prefix that maximises expected tokens per millisecond is verified
        3. verify   one packed target forward (runner.py, fastpath/batched.py): prompt chunks,
                    trees, plain rows
        4. commit   per request through its lane's Engine (verify, take, learn, report, finish);
                    the draft head extended for every request in one pass (head.py)
         ▼  StepOutput (step.py)  what the server, /metrics, the budget and the tests read
"""

from adaptivespec.batch.budget import CostTable, RowBudget
from adaptivespec.batch.engine import BatchEngine
from adaptivespec.batch.request import Request, Status
from adaptivespec.batch.scheduler import Scheduler, StepPlan

__all__ = ["BatchEngine", "CostTable", "Request", "RowBudget", "Scheduler", "Status", "StepPlan"]
