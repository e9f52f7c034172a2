"""RLlib side of the project: models, RLModules, algorithms and the command-line tools."""
