"""tests/gpu holds a script for a GPU machine (run.sh / check.py), not pytest tests."""

collect_ignore_glob = ["*"]
