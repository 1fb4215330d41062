"""The client's applications on the library: the ``specdec`` command line (``cli``), its chat
console (``console``) and what both print (``output``). The OpenAI gateway is
``drafter_client.gateway``."""
