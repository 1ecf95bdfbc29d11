"""The specloop command line: the commands (main.py), their options and runtime settings, training,
the operator's drafter commands, generate / demo / replay, and starting a deployment of Ray actors."""
