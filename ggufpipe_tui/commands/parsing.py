"""The command line shared by the front ends that read an inventory."""

from __future__ import annotations

import argparse


def inventory_parser(prog: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A parser whose first argument is the inventory file; ``description``
    and ``epilog`` are printed as written."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("inventory", metavar="INVENTORY", help="inventory YAML file")
    return parser
