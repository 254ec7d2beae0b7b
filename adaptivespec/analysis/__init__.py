"""Analysis tools: the measurements behind the tuning and draft-head decisions in the docs.

Each module runs as ``python -m adaptivespec.analysis.<name> --help`` and is importable (the tests
import them): ``shape_oracle`` (accepted length of every tree shape, teacher-forced, and what a
per-step shape policy could gain), ``tau_ceiling`` (static shapes and the ceiling replayed on
shape_oracle's saved trees), ``paired_compare`` (two contenders of a bench run on the prompts where
their texts agree), ``sampling_check`` (do speculative configs sample like plain decoding?),
``cost_aware_trace`` (what ``cost_aware`` learns across prompts), ``head_lineage`` (held-out
agreement of warm-started head runs on one token axis), and the tuning-set writers
``tuning_set``, ``heldout_mix_set`` and ``retrieval_tuning_set`` (training prompts only).
"""
