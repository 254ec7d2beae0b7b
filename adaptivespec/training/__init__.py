"""Training an EAGLE-3 draft head by self-distillation (``adaptivespec train-drafter``).

Modules: :mod:`.data` (training prompts, batched greedy self-distillation cached as token-id
JSONL, length-bucketed batches), :mod:`.vocab` (draft vocabulary by response-token frequency),
:mod:`.ttt` (EAGLE-3's training-time-test unroll and its loss), :mod:`.trainer` (optimiser,
schedule, checkpoints, validation, export) and :mod:`.cli` (the argparse subcommand).
"""

from __future__ import annotations
