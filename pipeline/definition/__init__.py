"""The pipeline definition: ``Pipeline`` and its builder, addressing, identity, ``quern.mix``, one-time scans."""
