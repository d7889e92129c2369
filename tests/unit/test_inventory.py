"""The inventory's checks of hand-started agents (listen:)."""

from __future__ import annotations

import pytest

from ggufpipe_tui.core.inventory import InventoryError, parse_inventory


def test_listen_key_needs_listen(tmp_path):
    text = "model: {path: m.gguf}\nhosts:\n  a: {local: true, listen_key: /k}\nstages:\n  - {host: a}\n"
    with pytest.raises(InventoryError, match=r"hosts.a.listen_key: goes with listen:"):
        parse_inventory(text, tmp_path / "inv.yaml")


def test_a_hand_started_agent_serves_one_stage(tmp_path):
    text = (
        "model: {path: m.gguf}\nhosts:\n  manual: {local: true, listen: '127.0.0.1:7000'}\n  b: {local: true}\n"
        "stages:\n  - {host: manual}\n  - {host: b}\n  - {host: manual}\n"
    )
    with pytest.raises(InventoryError) as refused:
        parse_inventory(text, tmp_path / "inv.yaml")
    assert str(refused.value).startswith(f"{tmp_path / 'inv.yaml'}:8: stages[2]: stage 0 runs on manual already")
    assert "one agent per stage" in str(refused.value)
