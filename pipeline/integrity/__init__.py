"""Determinism you can check: batch digests, the ledger, ``quern verify``."""
