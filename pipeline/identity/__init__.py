"""What a definition is: its description, fingerprint and config form, and the content digests under them."""
