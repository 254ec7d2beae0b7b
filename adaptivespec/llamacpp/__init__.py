"""The ``llamacpp`` runtime: the project's speculation on llama.cpp's kernels, reading a GGUF file.

Importing this package never imports ``llama_cpp``: :mod:`~adaptivespec.llamacpp.binding` does,
when a runtime is built. One concept per module:

* :mod:`~adaptivespec.llamacpp.binding` -- the pinned ``llama-cpp-python`` release, every call the
  runtime makes (checked at load: one line when one is missing), the layer-input staging API
  bound by its C++ names, and thin wrappers (model, context, batch).
* :mod:`~adaptivespec.llamacpp.target` -- ``model.target`` as a GGUF file, and its torch side
  (tokenizer, config, token embeddings for the head); a transformers folder is refused with the
  command that converts it.
* :mod:`~adaptivespec.llamacpp.cells` -- a verify tree as sequences of a unified KV cache (one
  decode), and the commit that keeps the accepted path's cells in position order.
* :mod:`~adaptivespec.llamacpp.runtime` -- :class:`~adaptivespec.llamacpp.runtime.LlamaCppRuntime`,
  registered as ``llamacpp`` (prefill, plain steps, draft, verify, commit).

See docs/llamacpp.md.
"""
