"""What the tests and the benchmarks both use: verifier processes and the readiness poller
(``process``), in-thread servers (``servers``), tiny models built from a config
(``tiny_models``), and network namespaces with a shaped link (``netns``). Nothing here imports
the test tree."""
