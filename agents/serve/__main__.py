"""`python -m agents.serve`: the policy server's command line (`agents.serve.cli.main`)."""
import sys

from agents.serve.cli import main

sys.exit(main())
