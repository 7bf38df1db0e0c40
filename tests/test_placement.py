"""Bytes per device with the routed experts split over N devices (model/placement.py, k3c inspect --devices)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from k3c.model import K3Config
from k3c.model.accounting import account
from k3c.model.placement import HEADROOM, expert_ranges, fits, smallest_fit, split

K3C = Path(sys.executable).with_name("k3c")


def test_expert_ranges_are_contiguous_and_differ_by_at_most_one():
    assert [len(r) for r in expert_ranges(10, 4)] == [3, 3, 2, 2]
    assert [r.start for r in expert_ranges(10, 4)] == [0, 3, 6, 8]
    assert [len(r) for r in expert_ranges(896, 16)] == [56] * 16


def test_k3_split_sums_to_the_one_device_figure():
    cfg = K3Config.preset("k3")
    f = account(cfg, 131072)
    one = split(f, cfg.num_experts, 1)[0].total
    for n in (2, 16, 896):
        rows = split(f, cfg.num_experts, n)
        assert sum(r.total for r in rows) == one
        assert all(r.state == 0 for r in rows[1:])
    # 92 MoE layers x 56 experts x 17,547,264 MXFP4 bytes on each of 16 devices
    assert split(f, cfg.num_experts, 16)[5].weights == 92 * 56 * 17_547_264


def test_smallest_fit_is_the_first_n_that_fits():
    cfg = K3Config.preset("k3")
    f = account(cfg, 131072)
    memory = int(288e9)
    n = smallest_fit(f, cfg.num_experts, memory)
    assert fits(split(f, cfg.num_experts, n), memory) and not fits(split(f, cfg.num_experts, n - 1), memory)
    assert max(r.total for r in split(f, cfg.num_experts, n)) <= memory * (1 - HEADROOM)


def test_inspect_devices_json():
    r = subprocess.run([str(K3C), "inspect", "--preset", "k3", "--devices", "16", "--device-memory", "141", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["devices"]
    assert d["devices"] == 16 and len(d["per_device"]) == 16 and d["fits"] is False
    assert d["sum_bytes"] == sum(row["total_bytes"] for row in d["per_device"])
