"""The benchmark tool: ``python -m scripts.bench SUBCOMMAND`` (see ``--help``).

  suite     specdec side by side with transformers: systems, k, temperature, context, rtt
  client    per-client speed: drafting methods next to transformers' best, two-host overlap
  batching  aggregate tokens/s of one verifier under N concurrent clients, batching on vs off
  network   client and verifier in two network namespaces, with added delay (root)
  profile   where a block's time goes: drafter step, target forward, plain HF vs specdec
  attack    idle, slowloris and stalled-body connections next to a normal client
  report    rebuild tables, CSV and plots from saved suite results, measuring nothing

Every subcommand shares the same base options (``--target``, ``--drafter``, ``--threads``,
``--dtype``, ``--max-new-tokens``, ``--out``), starts and stops its verifier the same way, reads
its prompts from ``benchmarks/prompts/`` and prints Markdown tables and writes JSON.
"""
