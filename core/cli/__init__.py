"""The command line: `python -m core generate | compare | install-models`."""
