"""``adaptivespec serve --runtime torch``: an OpenAI-compatible HTTP server over adaptivespec's own
engine (:class:`~adaptivespec.decode.Engine`) and the config's strategies, one generation at a time.

One concept per file: :mod:`~adaptivespec.server.schema` (request bodies, checked into one-line
4xx errors), :mod:`~adaptivespec.server.worker` (the generation thread, its bounded FIFO queue,
cancellation at the next step), :mod:`~adaptivespec.server.output` (text, stop strings, response
and chunk objects), :mod:`~adaptivespec.server.metrics` (``/metrics``: the SGLang path's
``adaptivespec_*`` series and the server's own), :mod:`~adaptivespec.server.app` (the FastAPI
routes) and :mod:`~adaptivespec.server.launch` (its flags, start-up; ``serve``'s front door,
:mod:`adaptivespec.serve`, hands over to it). See docs/torch-server.md.
"""
