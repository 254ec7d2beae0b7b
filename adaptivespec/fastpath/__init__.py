"""The torch runtime's speed pieces: what makes :class:`~adaptivespec.runtime.TorchRuntime` fast
without changing what it computes.

* :mod:`~adaptivespec.fastpath.forward`: the fused bfloat16 forward of Llama-layout targets;
* :mod:`~adaptivespec.fastpath.drafter`: the same for the EAGLE-3 head;
* :mod:`~adaptivespec.fastpath.prepack`: weights laid out once for oneDNN (bf16 on a CPU);
* :mod:`~adaptivespec.fastpath.attention`: tree attention with the KV heads kept grouped;
* :mod:`~adaptivespec.fastpath.kvcache`: a KV cache that appends in place;
* :mod:`~adaptivespec.fastpath.bank`: the shape bank, one executor per selectable tree shape;
* :mod:`~adaptivespec.fastpath.cuda_graphs`: CUDA graphs applied from outside (the
  ``torch-cuda-graphs`` runtime).
* :mod:`~adaptivespec.fastpath.costs`: the measured cost table of this machine's forwards (the
  batch engine's row budget and the cost-pricing policies' ``costs: measured``).

Nothing here is imported by this package's ``__init__``: each module is loaded by what uses it.
"""
