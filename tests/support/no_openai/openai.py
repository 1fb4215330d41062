"""Put on PYTHONPATH to run as on the GPU machine, which has no ``openai``: importing it fails."""

raise ImportError("openai is not installed here (tests/support/no_openai stands for a machine "
                  "without it)")
