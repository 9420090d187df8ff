"""How the project's command-line tools end (`ending.py`): one `error:` line for a refusal, a traceback for a bug."""
