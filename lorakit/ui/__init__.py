"""`lorakit ui`: a local web dashboard over run folders (runs.py reads them; server.py serves them)."""
