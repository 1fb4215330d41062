"""The verifier's model-thread side: sessions and their quotas (``sessions.py``), requests
checked against the model and the session (``validation.py``), the jobs that turn a request into
an engine step and a verdict into a reply (``jobs.py``, ``generate.py``, ``beam.py``), and the
scheduler that batches concurrent jobs into one forward (``scheduler.py``). The HTTP side
(``verifier_service/``: app, routes, guards) submits jobs and never touches the engine."""
