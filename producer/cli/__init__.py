"""The sdq command line: `main.py` assembles the command groups; `common.py` is what they share."""
