"""Helpers shared by the tests and the benchmark tool (``scripts/bench``).

* :mod:`tests.support.process` - a free port, one readiness poller, a verifier subprocess;
* :mod:`tests.support.live_server` - a verifier app served by uvicorn in a thread;
* :mod:`tests.support.tiny_models` - tiny random models + an offline tokenizer, a greedy reference;
* :mod:`tests.support.fault_proxy` - an HTTP proxy that delays or drops responses;
* :mod:`tests.support.netns` - client and verifier in two network namespaces.
"""
