"""Helpers the test modules share (fixtures stay in tests/conftest.py): ``launch`` runs commands and launched jobs,
``trainers`` builds small trainer configs and reads their logs."""
