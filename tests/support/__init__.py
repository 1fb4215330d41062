"""What only the tests use (what the benchmarks share with them is in ``tests/support/``).

* :mod:`tests.support.live_server` - the verifier app served by uvicorn in a thread;
* :mod:`tests.support.in_process` - the client's ``Verifier`` protocol on the verifier's own
  jobs, without sockets;
* :mod:`tests.support.statistics` - exact distributions and the chi-square comparison;
* :mod:`tests.support.fault_proxy` - an HTTP proxy that delays or drops responses;
* :mod:`tests.support.containers`, ``prometheus``, ``min_transformers_check``, ``no_openai``.
"""
