"""ggufpipe's orchestrator: ggufpipe-tui (docs/architecture.md has the map)."""

import warnings

# asyncssh loads its DSA support when it is imported, and cryptography 47 and
# later warn then that DSA is going away; ggufpipe offers and accepts no DSA
# key, so the warning says nothing about a run, and on stderr it would stand
# before the one error line a failed set-up prints.
warnings.filterwarnings("ignore", message="DSA is deprecated", module="asyncssh")
