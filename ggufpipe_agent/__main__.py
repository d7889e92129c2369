import sys

from ggufpipe_agent.cli import main

sys.exit(main())
