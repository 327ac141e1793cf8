"""Helpers shared by the tests (importable as ``support``: ``pythonpath = ["tests"]`` in pyproject.toml): the
process pool (``harness``), the checks its ranks run (``cases``, ``cases_extra``, ``equivalence``), small
networks (``models``) and command lines (``argv``)."""
