"""llama.cpp through ``llama-cpp-python``'s low-level ctypes API: the few calls the runtime makes.

Only this module imports ``llama_cpp``, and only when a runtime is built (:func:`lib`), so the
plugin registers everywhere and a missing or different binding is one line at load. Besides the
public C API (``llama.h``), the EAGLE-3 features come from llama.cpp's staging API
(``src/llama-ext.h``), which ``llama-cpp-python`` does not bind: ``libllama.so`` exports it under
C++ names, bound here with ctypes::

    void   llama_set_embeddings_layer_inp(llama_context *, uint32_t lid, bool)   _Z30llama_set_embeddings_layer_inpP13llama_contextjb
    float *llama_get_embeddings_layer_inp(llama_context *, uint32_t lid)         _Z30llama_get_embeddings_layer_inpP13llama_contextj

``lid`` is the *input* of layer ``lid``, i.e. the output of layer ``lid - 1`` (transformers'
``hidden_states[lid]``); after a decode it holds one row of ``n_embd`` floats per batch token,
in batch order, until the next decode overwrites it. Reading a layer that was not enabled aborts
the process (a GGML_ASSERT), so :class:`Context` remembers which are.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

from adaptivespec.errors import AdaptiveSpecError

PINNED = "0.3.36"
"""The ``llama-cpp-python`` release this runtime is written and tested against (``pip install -e .[llamacpp]``)."""
INSTALL = f"pip install 'llama-cpp-python=={PINNED}' (or pip install -e '.[llamacpp]'; it compiles llama.cpp, minutes)"

C_API = ("llama_backend_init", "llama_log_set", "llama_model_default_params", "llama_model_load_from_file",
         "llama_model_free", "llama_model_get_vocab", "llama_vocab_n_tokens", "llama_model_n_embd", "llama_model_n_layer",
         "llama_context_default_params", "llama_init_from_model", "llama_free", "llama_batch_init", "llama_batch_free",
         "llama_decode", "llama_get_logits", "llama_get_memory", "llama_memory_clear", "llama_memory_seq_rm",
         "llama_memory_seq_cp", "llama_memory_seq_pos_max", "llama_state_seq_get_size", "llama_state_seq_get_data",
         "llama_state_seq_set_data", "llama_tokenize", "llama_set_n_threads", "llama_n_ctx")
"""Every function of ``llama_cpp.llama_cpp`` the runtime calls."""
CONTEXT_FIELDS = ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads", "n_threads_batch", "kv_unified", "no_perf")
SET_LAYER_INP = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"
GET_LAYER_INP = "_Z30llama_get_embeddings_layer_inpP13llama_contextj"

_LIB = None


class BindingError(AdaptiveSpecError):
    """The binding is missing or lacks a call the runtime makes."""


class Lib:
    """The ``llama_cpp.llama_cpp`` module, the two staging-API functions, and the backend initialised once."""

    def __init__(self, ll, set_layer_inp, get_layer_inp, version: str, path: str) -> None:
        self.ll, self.set_layer_inp, self.get_layer_inp = ll, set_layer_inp, get_layer_inp
        self.version, self.path = version, path
        ll.llama_backend_init()
        self._log = ll.llama_log_callback(_log)  # kept: llama.cpp holds the pointer
        ll.llama_log_set(self._log, ctypes.c_void_p(0))


def _log(level: int, text: bytes, data) -> None:
    """llama.cpp's log: warnings (3) and errors (4) only; the loader's chatter is dropped."""
    if level in (3, 4) and text:
        sys.stderr.write("llama.cpp: " + text.decode(errors="replace"))


def lib() -> Lib:
    """The binding, loaded and checked once; a :class:`BindingError` (one line) when it is missing or
    lacks any call the runtime makes."""
    global _LIB
    if _LIB is not None:
        return _LIB
    try:
        import llama_cpp
        from llama_cpp import llama_cpp as ll
    except ImportError as exc:
        raise BindingError(f"runtime.name: llamacpp needs the llama-cpp-python binding ({exc}); install it: {INSTALL}") from None
    version = getattr(llama_cpp, "__version__", "?")
    missing = [name for name in C_API if not hasattr(ll, name)]
    params = getattr(ll, "llama_context_params", None)
    fields = {f[0] for f in getattr(params, "_fields_", ())}
    missing += [f"llama_context_params.{f}" for f in CONTEXT_FIELDS if f not in fields]
    cdll = getattr(ll, "_lib", None)
    symbols = {}
    for sym in (SET_LAYER_INP, GET_LAYER_INP):
        try:
            symbols[sym] = getattr(cdll, sym)
        except AttributeError:
            missing.append(f"{sym} (llama-ext.h's layer-input API, exported by libllama.so)")
    if missing:
        raise BindingError(f"runtime.name: llamacpp: llama-cpp-python {version} lacks {', '.join(missing[:4])}; "
                           f"expected llama-cpp-python=={PINNED}: {INSTALL}")
    set_inp, get_inp = symbols[SET_LAYER_INP], symbols[GET_LAYER_INP]
    set_inp.argtypes, set_inp.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
    get_inp.argtypes, get_inp.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)
    _LIB = Lib(ll, set_inp, get_inp, version, str(getattr(cdll, "_name", "?")))
    return _LIB


class Model:
    """A GGUF file loaded by llama.cpp (weights on the CPU, memory-mapped)."""

    def __init__(self, path: Path) -> None:
        self.lib = lib()
        ll = self.lib.ll
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        self.ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise AdaptiveSpecError(f"model.target: {path}: llama.cpp cannot load this file (see its error above); "
                                    "expected a GGUF model file")
        self.path = Path(path)
        self.vocab = ll.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self.vocab))
        self.n_embd = int(ll.llama_model_n_embd(self.ptr))
        self.n_layer = int(ll.llama_model_n_layer(self.ptr))

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """llama.cpp's own tokenization of ``text`` (no BOS; special tokens parsed when ``special``)."""
        ll = self.lib.ll
        raw = text.encode()
        cap = len(raw) + 16
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self.vocab, raw, len(raw), buf, cap, False, special)
        if n < 0:
            raise AdaptiveSpecError(f"llama.cpp: tokenizing {text[:40]!r} needs {-n} tokens, more than {cap}")
        return list(buf[:n])

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            self.lib.ll.llama_model_free(ptr)


class Batch:
    """A ``llama_batch`` of up to ``capacity`` tokens, each in up to ``n_seq_max`` sequences, with
    numpy views of its arrays (filled without a Python loop over ctypes)."""

    def __init__(self, ll, capacity: int, n_seq_max: int) -> None:
        self.ll, self.capacity, self.n_seq_max = ll, capacity, n_seq_max
        self.b = ll.llama_batch_init(capacity, 0, n_seq_max)
        self.token = np.ctypeslib.as_array(self.b.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(self.b.pos, shape=(capacity,))
        self.n_seq_id = np.ctypeslib.as_array(self.b.n_seq_id, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(self.b.logits, shape=(capacity,))
        self.seq_rows = [np.ctypeslib.as_array(self.b.seq_id[i], shape=(n_seq_max,)) for i in range(capacity)]

    def fill(self, tokens, positions, seqs: list[list[int]] | None, logits) -> None:
        """Rows ``tokens`` [n] at ``positions`` [n]; ``seqs``: each row's sequence ids (None: all in seq 0);
        ``logits``: bool [n] or a bool, whether a row's logits are kept."""
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"a batch of {n} tokens exceeds the batch capacity {self.capacity}")
        self.b.n_tokens = n
        self.token[:n] = tokens
        self.pos[:n] = positions
        self.logits[:n] = logits
        if seqs is None:
            self.n_seq_id[:n] = 1
            for i in range(n):
                self.seq_rows[i][0] = 0
        else:
            for i, s in enumerate(seqs):
                self.n_seq_id[i] = len(s)
                self.seq_rows[i][: len(s)] = s

    def __del__(self) -> None:
        b, self.b = getattr(self, "b", None), None
        if b is not None:
            self.ll.llama_batch_free(b)


class Context:
    """A llama.cpp context over :class:`Model`: a unified KV cache of ``n_ctx`` cells shared by
    ``n_seq_max`` sequences, ``threads`` threads, and the layer inputs ``layer_inputs`` (lids) kept
    after every decode."""

    def __init__(self, model: Model, *, n_ctx: int, n_batch: int, n_seq_max: int, threads: int,
                 layer_inputs: tuple[int, ...] = ()) -> None:
        self.model, self.lib = model, model.lib
        ll = self.ll = self.lib.ll
        p = ll.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_batch, n_seq_max
        p.n_threads = p.n_threads_batch = threads
        p.kv_unified = True  # one KV stream: a token may belong to several sequences (tree nodes)
        p.no_perf = True
        self.ptr = ll.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise AdaptiveSpecError(f"llama.cpp: cannot create a context of {n_ctx} cells for {model.path} (see its error above)")
        self.n_ctx, self.n_batch, self.n_seq_max, self.threads = int(ll.llama_n_ctx(self.ptr)), n_batch, n_seq_max, threads
        self.mem = ll.llama_get_memory(self.ptr)
        self.layer_inputs = tuple(layer_inputs)
        for lid in self.layer_inputs:
            self.lib.set_layer_inp(self.ptr, lid, True)
        self.batch = Batch(ll, n_batch, n_seq_max)

    def decode(self, tokens, positions, seqs=None, logits=True) -> None:
        """One ``llama_decode`` of a batch (see :meth:`Batch.fill`)."""
        self.batch.fill(tokens, positions, seqs, logits)
        rc = self.ll.llama_decode(self.ptr, self.batch.b)
        if rc != 0:
            raise AdaptiveSpecError(f"llama.cpp: llama_decode of {len(tokens)} tokens returned {rc} "
                                    f"(KV cache of {self.n_ctx} cells full, or an invalid batch)")

    def logits(self, n: int) -> np.ndarray:
        """[n, V] float32: the logits of the last decode's ``n`` kept rows, in batch order (a view,
        valid until the next decode)."""
        return np.ctypeslib.as_array(self.ll.llama_get_logits(self.ptr), shape=(n, self.model.n_vocab))

    def layer_input(self, lid: int, n: int) -> np.ndarray:
        """[n, n_embd] float32: the input of layer ``lid`` for each of the last decode's ``n`` tokens (a view)."""
        if lid not in self.layer_inputs:
            raise ValueError(f"layer input {lid} was not enabled (reading it would abort llama.cpp)")
        return np.ctypeslib.as_array(self.lib.get_layer_inp(self.ptr, lid), shape=(n, self.model.n_embd))

    # -- the KV cache ----------------------------------------------------------------------------
    def clear(self) -> None:
        self.ll.llama_memory_clear(self.mem, True)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Cells of ``src`` at positions [p0, p1) join ``dst`` (the same cells: no copy)."""
        self.ll.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Cells at positions [p0, p1) leave ``seq``; a cell left in no sequence is freed."""
        self.ll.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        return int(self.ll.llama_memory_seq_pos_max(self.mem, seq))

    def save_seq(self, seq: int) -> bytes:
        """Sequence ``seq``'s cells (positions, K and V of every layer), in cell order."""
        ll = self.ll
        size = ll.llama_state_seq_get_size(self.ptr, seq)
        buf = (ctypes.c_uint8 * size)()
        written = ll.llama_state_seq_get_data(self.ptr, buf, size, seq)
        if written != size:
            raise AdaptiveSpecError(f"llama.cpp: saving sequence {seq} wrote {written} of {size} bytes")
        return bytes(buf)

    def load_seq(self, data: bytes, seq: int) -> None:
        """:meth:`save_seq`'s cells back into ``seq``, in contiguous cells from the first free one."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        read = self.ll.llama_state_seq_set_data(self.ptr, buf, len(data), seq)
        if read != len(data):
            raise AdaptiveSpecError(f"llama.cpp: restoring sequence {seq} read {read} of {len(data)} bytes")

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            self.batch = None
            self.ll.llama_free(ptr)
