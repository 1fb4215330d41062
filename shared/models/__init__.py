"""Models by name: the catalogue of short names and how a spec loads (``catalog``), and fetching
the offline pair onto this machine (``fetch``; the ``specdec-fetch`` command)."""


class ModelSpecError(ValueError):
    """The model spec names nothing that can be loaded here."""
